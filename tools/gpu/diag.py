"""Where does batch/chunk invariance break on CUDA? Linear rows by M, mv vs gemm, tiled attention
by query count; plus engine step costs. Writes $OUT/diag.json."""
import json
import os
import time

import torch
import torch.nn.functional as F

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import load_model
from gateway.engine.parity.probe import probe_invariance


def timed(fn, reps=5):
    fn(); torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return round(sorted(ts)[len(ts) // 2], 2)

Ms = [1, 2, 3, 4, 5, 8, 12, 16, 32, 64, 100, 128, 256, 512, 1024]
results = {}
for kind, dtype in [("smol", torch.float32), ("smol", torch.bfloat16), ("1b", torch.bfloat16)]:
    name = f"{kind}-{str(dtype).removeprefix('torch.')}"
    loaded = load_model(f"/tmp/models/{kind}", dtype=dtype, device="cuda")
    layer = loaded.model.model.layers[0]
    row = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for lname, lin in [("q", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                       ("up", layer.mlp.up_proj), ("down", layer.mlp.down_proj)]:
        w = lin.weight
        x = torch.randn(1024, w.shape[1], device="cuda", dtype=dtype, generator=g)
        ref = F.linear(x, w)[:1]
        row[f"lin_{lname}_M_equal_1024"] = [M for M in Ms if torch.equal(F.linear(x[:M], w)[:1], ref)]
        row[f"lin_{lname}_mv_equal_M1"] = bool(torch.equal(torch.mv(w, x[0]), F.linear(x[:1], w)[0]))
    att = TiledAttention()
    H = loaded.model.config.num_attention_heads; KVH = loaded.model.config.num_key_value_heads
    D = getattr(loaded.model.config, "head_dim", None) or loaded.model.config.hidden_size // H
    n = 700
    q = torch.randn(n, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(KVH, 1024, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(KVH, 1024, D, device="cuda", dtype=dtype, generator=g)
    pos = torch.arange(n, device="cuda")
    full = att(q, k, v, pos)
    row["att_last_row_alone_equal"] = bool(torch.equal(att(q[-1:], k, v, pos[-1:]), full[-1:]))
    row["att_last4_equal"] = bool(torch.equal(att(q[-4:], k, v, pos[-4:]), full[-4:]))
    row["att_last100_equal"] = bool(torch.equal(att(q[-100:], k, v, pos[-100:]), full[-100:]))
    fw = BatchedForward(loaded.model, att)
    vocab = int(loaded.model.config.vocab_size)
    probe = probe_invariance(fw, loaded.layout, vocab)
    row.update(probe_invariant=probe.is_invariant, probe_failure=probe.failure,
               probe_s=round(probe.seconds, 2), decode_kv_is_prefill_kv=probe.decode_kv_is_prefill_kv)
    N = 2048
    ids = torch.randint(0, vocab, (N,))
    def batched_prefill(chunk):
        def go():
            seq = KVSequence(loaded.layout, N + 512, device="cuda")
            for s in range(0, N, chunk):
                fw.forward([SequenceRows(sequence=seq, tokens=ids[s:s + chunk], wants_logits=s + chunk >= N)])
        return go
    def hf_prefill():
        with torch.inference_mode():
            loaded.model(input_ids=ids[None].cuda(), logits_to_keep=1)
    row["prefill_2k_engine_oneshot_ms"] = timed(batched_prefill(N))
    row["prefill_2k_engine_256chunks_ms"] = timed(batched_prefill(256))
    row["prefill_2k_hf_oneshot_ms"] = timed(hf_prefill)
    seqs = []
    for i in range(8):
        s = KVSequence(loaded.layout, N + 1024, device="cuda")
        fw.forward([SequenceRows(sequence=s, tokens=torch.randint(0, vocab, (N,)), wants_logits=False)])
        seqs.append(s)
    def decode(kk):
        def go():
            fw.forward([SequenceRows(sequence=s, tokens=torch.randint(0, vocab, (1,)), wants_logits=True, is_decode=True) for s in seqs[:kk]])
        return go
    row["decode_1seq_2k_ms"] = timed(decode(1), reps=9)
    row["decode_8seq_2k_ms"] = timed(decode(8), reps=9)
    results[name] = row
    print(name, json.dumps(row), flush=True)
    del loaded, fw, seqs; torch.cuda.empty_cache()
json.dump(results, open(f"{os.environ.get('OUT', '/tmp/out')}/diag.json", "w"), indent=1)
