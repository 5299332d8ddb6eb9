"""``kvgate bench soak``: a small deployment under a mixed load while things fail (issue 44).

Two ``kvgate serve`` replicas sharing one ``redis-server`` (each with its own disk tier) are
driven by a fixed number of client threads for ``--minutes``; faults hit Redis, the disk and
the replicas on a schedule (``faults``); every answer is compared with the cold answer of its
prompt (``oracle``), and errors are classed by whether they fell inside a fault's window
(``report``). The processes are this package's own (``processes``): started, killed and
restarted by pid, on the same ports and data directories, and stopped at the end.
"""
