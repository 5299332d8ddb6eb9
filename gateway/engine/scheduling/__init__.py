"""Who runs in the next step and how it runs: the scheduler's plan, the step loop on its one
thread, the requests it holds (jobs, their records and failures), their cached blocks and their
preemption."""
