"""Benchmark flatshard.packing: packing efficiency, packer speed, packed vs padded throughput.

    .venv/bin/python bench/bench_packing.py [--out results.json] [--steps 12] [--quick]

1. Efficiency (real tokens / slots) of every algorithm on the embedded corpus (byte tokens + eos,
   long documents split) at capacities 512/1024/2048, next to padded batching.
2. Wall time of ``pack(..., algorithm="bfd")`` (and ffd) on 200k random lengths.
3. Real-token throughput of a small transformer's forward+backward on CPU: packed rows with
   ``varlen_attention`` vs padding each batch to its longest document (random batches, and
   length-bucketed batches), steps interleaved, medians compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatshard.packing import (
    ALGORITHMS,
    bucket_by_length,
    collate,
    pack,
    packing_report,
    padding_efficiency,
    split_long_documents,
    varlen_attention,
)


def corpus_token_docs() -> tuple[list[list[int]], str]:
    """Byte-token documents (eos appended) of the embedded corpus, and the corpus name."""
    try:
        from flatshard.data.corpus import embedded_documents
        from flatshard.data.tokenizer import ByteTokenizer

        tok = ByteTokenizer()
        return [tok.encode(t) for t in embedded_documents()], "flatshard.data.corpus"
    except ImportError:
        from pydoc_data.topics import topics

        docs = [[*t.encode("utf-8", "surrogatepass"), 256] for t in topics.values()]
        return docs, "pydoc_data.topics (fallback)"


def efficiency_table(lengths: list[int]) -> list[dict]:
    rows = []
    for capacity in (512, 1024, 2048):
        chunks = [c.length for c in split_long_documents(lengths, capacity)]
        for algorithm in ALGORITHMS:
            gc.collect()  # a pending collection would land in a 10 ms timing
            start = time.perf_counter()
            bins = pack(lengths, capacity, algorithm=algorithm, split_long=True)
            seconds = time.perf_counter() - start
            report = packing_report(bins, chunks, capacity)
            rows.append(
                {
                    "capacity": capacity,
                    "method": algorithm,
                    "bins": report.num_bins,
                    "lower_bound": report.lower_bound_bins,
                    "efficiency": report.efficiency,
                    "seconds": seconds,
                }
            )
        for name, batches in (
            ("padded random x8", _random_batches(len(chunks), 8)),
            ("padded bucketed x8", bucket_by_length(chunks, batch_size=8)),
        ):
            rows.append(
                {
                    "capacity": capacity,
                    "method": name,
                    "bins": len(batches),
                    "lower_bound": None,
                    "seconds": None,
                    "efficiency": padding_efficiency(batches, chunks),
                }
            )
    return rows


def _random_batches(n: int, size: int, seed: int = 0) -> list[list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i : i + size] for i in range(0, n, size)]


def packer_timing(n: int = 200_000, capacity: int = 2048, repeats: int = 3) -> dict:
    rng = random.Random(0)
    lengths = [min(capacity, int(rng.lognormvariate(5.5, 1.0)) + 1) for _ in range(n)]
    out = {"n": n, "capacity": capacity}
    for algorithm in ("bfd", "ffd"):
        times = []
        for _ in range(repeats):
            gc.collect()
            start = time.perf_counter()
            bins = pack(lengths, capacity, algorithm=algorithm)
            times.append(time.perf_counter() - start)
        out[f"{algorithm}_seconds"] = statistics.median(times)
        out[f"{algorithm}_efficiency"] = packing_report(bins, lengths, capacity).efficiency
    return out


# --- a small transformer whose attention is swappable --------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        b, t, d = x.shape  # [B, T, D]
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(attend(q, k, v).reshape(b, t, d))  # attend: [B, T, H, hd] -> same
        return x + self.mlp(self.ln2(x))


class SmallLM(nn.Module):
    def __init__(
        self, vocab: int = 258, dim: int = 128, heads: int = 4, layers: int = 2, max_len: int = 512
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def _padded_attend(q, k, v):
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)  # right padding + causal: real tokens never see padding


def _packed_attend(batch):
    def attend(q, k, v):
        b, t, h, d = q.shape
        flat = (x.reshape(b * t, h, d) for x in (q, k, v))
        return varlen_attention(*flat, batch.cu_seqlens, batch.max_seqlen).view(b, t, h, d)

    return attend


def _padded_batch(docs: list[list[int]]) -> tuple:
    """``(real_tokens, ids, pos, labels, attend)`` with every row padded to the longest doc."""
    longest = max(map(len, docs))
    ids = torch.full((len(docs), longest), 257, dtype=torch.long)
    labels = torch.full((len(docs), longest), -100, dtype=torch.long)
    for r, d in enumerate(docs):
        ids[r, : len(d)] = torch.tensor(d)
        labels[r, : len(d) - 1] = torch.tensor(d[1:])
    pos = torch.arange(longest).expand(len(docs), -1)
    return sum(map(len, docs)), ids, pos, labels, _padded_attend


def _step(model, ids, pos, labels, attend) -> float:
    start = time.perf_counter()
    logits = model(ids, pos, attend)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _variants(docs: list[list[int]], seq_len: int, rows: int, limit: int) -> dict[str, list[tuple]]:
    """Per variant, its first ``limit`` batches as ``(real_tokens, ids, pos, labels, attend)``
    (only those are timed: building all of them took longer than the timing)."""
    chunks = split_long_documents([len(d) for d in docs], seq_len)
    pool = [docs[c.doc][c.start : c.end] for c in chunks if c.length > 1]
    random.Random(0).shuffle(pool)
    bins = pack([len(d) for d in pool], seq_len)
    random.Random(1).shuffle(bins)  # bfd emits longest-first; train (and time) in random order
    packed = []
    for i in range(0, min(len(bins), limit * rows), rows):
        group = [pool[j] for b in bins[i : i + rows] for j in b]
        batch = collate(group, seq_len, pad_id=257, rows=rows)
        packed.append(
            (
                sum(map(len, group)),
                batch.input_ids,
                batch.position_ids,
                batch.labels,
                _packed_attend(batch),
            )
        )
    random_batches = [pool[i : i + rows] for i in range(0, len(pool), rows)][:limit]
    buckets = bucket_by_length([len(d) for d in pool], batch_size=rows)[:limit]
    return {
        "packed": packed,
        "padded": [_padded_batch(group) for group in random_batches],
        "bucketed": [_padded_batch([pool[j] for j in b]) for b in buckets],
    }


def throughput(docs: list[list[int]], steps: int, seq_len: int = 512, rows: int = 8) -> dict:
    """Real tokens/s of forward+backward per variant; steps interleaved, medians compared."""
    torch.manual_seed(0)
    model = SmallLM(max_len=seq_len)
    variants = _variants(docs, seq_len, rows, limit=steps + 2)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(steps + 2):  # 2 warm-up rounds
        for name, batches in variants.items():
            tokens, *args = batches[i % len(batches)]
            seconds = _step(model, *args)
            if i >= 2:
                rates[name].append(tokens / seconds)
    med = {name: statistics.median(r) for name, r in rates.items()}
    return {
        "seq_len": seq_len,
        "rows": rows,
        "steps": steps,
        **{f"{k}_tokens_per_s": v for k, v in med.items()},
        "packed_over_padded": med["packed"] / med["padded"],
        "packed_over_bucketed": med["packed"] / med["bucketed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per variant (default 12; --quick: 4)"
    )
    parser.add_argument("--quick", action="store_true", help="20k lengths, 4 steps by default")
    args = parser.parse_args()
    torch.set_num_threads(1)
    docs, corpus = corpus_token_docs()
    lengths = [len(d) for d in docs]
    print(f"corpus: {corpus}, {len(docs)} documents, {sum(lengths)} tokens")
    table = efficiency_table(lengths)
    print(f"{'capacity':>8}  {'method':<20}{'bins':>7}{'lower':>7}{'efficiency':>12}{'time s':>9}")
    for r in table:
        lower = "" if r["lower_bound"] is None else r["lower_bound"]
        secs = "" if r["seconds"] is None else f"{r['seconds']:.3f}"
        print(
            f"{r['capacity']:>8}  {r['method']:<20}{r['bins']:>7}{lower:>7}"
            f"{r['efficiency']:>12.2%}{secs:>9}"
        )
    timing = packer_timing(n=20_000 if args.quick else 200_000)
    print(
        f"pack {timing['n']} lengths (capacity {timing['capacity']}): "
        f"bfd {timing['bfd_seconds']:.2f} s, ffd {timing['ffd_seconds']:.2f} s"
    )
    steps = args.steps if args.steps is not None else (4 if args.quick else 12)
    speed = throughput(docs, steps=steps)
    print(
        f"forward+backward real tokens/s (seq_len {speed['seq_len']}, {speed['rows']} rows): "
        f"packed {speed['packed_tokens_per_s']:.0f}, padded {speed['padded_tokens_per_s']:.0f}"
        f", bucketed {speed['bucketed_tokens_per_s']:.0f}; packed/padded "
        f"{speed['packed_over_padded']:.2f}x, packed/bucketed {speed['packed_over_bucketed']:.2f}x"
    )
    result = {"corpus": corpus, "efficiency": table, "packer_timing": timing, "throughput": speed}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
