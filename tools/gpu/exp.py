"""GPU experiment: where the batched forward's time goes (profile), and a candidate attention
through torch's memory-efficient kernel in fixed shapes (128-query calls, keys in multiples of
512, float mask): does the start-up probe pass with it, and what does it cost? -> $OUT/exp.json"""
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.forward.batched import BatchedForward, SequenceRows, projection_weights
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_padding import row_padding_for
from gateway.engine.linear.row_products import RowProducts
from gateway.engine.models.loading import load_model
from gateway.engine.parity.probe import probe_invariance

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QC, KB = 128, 512
def sync():
    if DEV == "cuda": torch.cuda.synchronize()

def op(q, k, v, bias, scale):
    if DEV == "cuda":
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, 0.0, False, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

class EffAttention:
    numerics = "e512q128"
    def attend(self, items):
        return [self._one(it) for it in items]
    def _one(self, item):
        q = item.queries; n, H, D = q.shape; kvh = item.keys.shape[0]; rep = H // kvh
        out = torch.empty_like(q)
        step = n if item.is_decode else QC
        for s in range(0, n, step):
            e = min(n, s + step); cnt = e - s; pad = cnt if item.is_decode else QC
            qq, pp = q[s:e], item.positions[s:e]
            if pad > cnt:
                qq = torch.cat([qq, qq.new_zeros(pad - cnt, H, D)]); pp = torch.cat([pp, pp[-1:].expand(pad - cnt)])
            nk = (int(pp.max()) // KB + 1) * KB
            rows = qq.view(pad, kvh, rep, D).permute(1, 0, 2, 3).reshape(1, kvh, pad * rep, D)
            rpos = pp.repeat_interleave(rep)
            bias = torch.zeros(pad * rep, nk, dtype=q.dtype, device=q.device)
            bias.masked_fill_(torch.arange(nk, device=q.device) > rpos[:, None], float("-inf"))
            o = op(rows, item.keys[None, :, :nk], item.values[None, :, :nk], bias[None, None].expand(1, kvh, pad * rep, nk), 1 / math.sqrt(D))
            out[s:e] = o[0].view(kvh, pad, rep, D).permute(1, 0, 2, 3).reshape(pad, H, D)[:cnt]
        return out

def timed(fn, reps=5):
    fn(); sync(); ts = []
    for _ in range(reps):
        sync(); t = time.perf_counter(); fn(); sync(); ts.append((time.perf_counter() - t) * 1e3)
    return round(sorted(ts)[len(ts) // 2], 2)

N = int(os.environ.get("EXP_N", 2048))
kinds = [k.split(":") for k in os.environ.get("EXP_KINDS", "smol:float32,smol:bfloat16,1b:bfloat16").split(",")]
results = {}
for kind, dt in kinds:
    dtype = getattr(torch, dt)
    loaded = load_model(f"/tmp/models/{kind}", dtype=dtype, device=DEV)
    vocab = int(loaded.model.config.vocab_size)
    padding = row_padding_for(torch.device(DEV), projection_weights(loaded.model), max_rows=1024)
    ids = torch.randint(0, vocab, (N,))
    def hf():
        with torch.inference_mode():
            loaded.model(input_ids=ids[None].to(DEV), logits_to_keep=1)
    row = {"padding": str(padding), "hf_oneshot_ms": timed(hf)}
    for aname, att in (("tiled", TiledAttention()), ("eff", EffAttention())):
        fw = BatchedForward(loaded.model, att, RowProducts(kernel="blas", padding=padding,
                                                           shares_decode_rows=False))
        try:
            probe = probe_invariance(fw, loaded.layout, vocab)
            row[f"{aname}_probe"] = [probe.is_invariant, probe.failure, round(probe.seconds, 2), probe.decode_kv_is_prefill_kv]
        except Exception as exc:  # noqa: BLE001
            row[f"{aname}_probe"] = f"error {exc!r}"[:300]; continue
        def prefill(chunk):
            def go():
                seq = KVSequence(loaded.layout, N + 512, device=DEV)
                for s in range(0, N, chunk):
                    fw.forward([SequenceRows(sequence=seq, tokens=ids[s:s + chunk], wants_logits=s + chunk >= N)])
            return go
        row[f"{aname}_oneshot_ms"] = timed(prefill(N)); row[f"{aname}_chunks256_ms"] = timed(prefill(256))
        seqs = []
        for i in range(8):
            sq = KVSequence(loaded.layout, N + 1024, device=DEV)
            fw.forward([SequenceRows(sequence=sq, tokens=torch.randint(0, vocab, (N,)), wants_logits=False)]); seqs.append(sq)
        for k in (1, 8):
            row[f"{aname}_decode{k}_ms"] = timed(lambda: fw.forward([SequenceRows(sequence=s, tokens=torch.randint(0, vocab, (1,)), wants_logits=True, is_decode=True) for s in seqs[:k]]), reps=7)
        if kind == "smol" and dt == "bfloat16" and DEV == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                prefill(N)(); sync()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
            open(f"{os.environ.get('OUT', '/tmp')}/prof-{aname}.txt", "w").write(table)
        del seqs
    results[f"{kind}-{dt}"] = row
    print(kind, dt, json.dumps(row), flush=True)
    del loaded
    if DEV == "cuda": torch.cuda.empty_cache()
json.dump(results, open(f"{os.environ.get('OUT', '/tmp')}/exp.json", "w"), indent=1)
