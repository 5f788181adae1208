"""Greedy list-scheduling model of the causal sm90 backward grid on 132 SMs (one CTA per SM).

CTA (batch, KV head, key block n) lasts qhpk x (query blocks - first query block of n) steps of c
µs plus o µs (the step and per-CTA costs fitted on 2026-12-02) and goes to the first free SM in its
launch order. Prints makespan / (total work / SMs) for the launch order (key blocks fastest) and
for orders with key blocks slowest within chunks of (batch, KV head) pairs: chunks of G pairs or of
k waves of CTAs (the last one the remainder), and even chunks of at least k waves (what
bwd_sm90.cuh's bwd_cta does). Exploration, kept as the record of how the chunk size was chosen; run with python3.
"""
import heapq
import math

SMS = 132
TILES = {64: (128, 128, 2.72, 3.1), 128: (64, 128, 2.24, 4.0), 192: (64, 96, 3.2, 4.5), 256: (64, 64, 2.6, 4.5)}


def makespan(order, duration):
    free = [0.0] * SMS
    end = 0.0
    for cta in order:
        start = heapq.heappop(free)
        end = max(end, start + duration[cta])
        heapq.heappush(free, start + duration[cta])
    return end


def causal_grid(head_dim, seqlen, gqa):
    """(durations by (pair, n), pairs, key blocks) at 16k tokens, hidden 2048."""
    block_m, block_n, step, per_cta = TILES[head_dim]
    batch, kv_heads = max(1, 16384 // seqlen), 2048 // head_dim // gqa
    m_blocks, n_blocks = seqlen // block_m, seqlen // block_n
    pairs = [(b, h) for b in range(batch) for h in range(kv_heads)]
    duration = {(pair, n): gqa * (m_blocks - n * block_n // block_m) * step + per_cta
                for pair in pairs for n in range(n_blocks)}
    return duration, pairs, n_blocks


def chunked_order(chunks, n_blocks):
    return [(pair, n) for chunk in chunks for n in range(n_blocks) for pair in chunk]


def fixed_chunks(pairs, size):
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


def even_chunks(pairs, min_size):
    count = max(1, len(pairs) // min_size)
    return [pairs[i * len(pairs) // count:(i + 1) * len(pairs) // count] for i in range(count)]


def main():
    for head_dim in TILES:
        for seqlen in (1024, 1500, 2048, 3000, 4096, 8192, 16384):
            for gqa in (1,) if head_dim == 192 else (1, 4):
                duration, pairs, n_blocks = causal_grid(head_dim, seqlen, gqa)
                ideal = sum(duration.values()) / SMS
                ratio = lambda chunks: round(makespan(chunked_order(chunks, n_blocks), duration) / ideal, 3)
                launch = [(pair, n) for pair in pairs for n in range(n_blocks)]
                fixed = {g: ratio(fixed_chunks(pairs, g)) for g in (1, 2, 4, 8, 16, 32)}
                waves = {k: math.ceil(k * SMS / n_blocks) for k in (1, 1.5, 2, 3)}  # pairs
                fixed_waves = {k: ratio(fixed_chunks(pairs, waves[k])) for k in (1, 2)}
                even = {k: ratio(even_chunks(pairs, size)) for k, size in waves.items()}
                print(f"d{head_dim} s{seqlen} gqa{gqa} key blocks {n_blocks}: launch order "
                      f"{makespan(launch, duration) / ideal:.3f}, chunks of G pairs {fixed}, of k waves (the last "
                      f"the remainder) {fixed_waves}, even chunks of k waves {even}")


if __name__ == "__main__":
    main()
