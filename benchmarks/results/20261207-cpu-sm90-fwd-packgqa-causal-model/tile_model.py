"""The share of a causal forward's MMA work that is useful, by tile shape and PackGQA: each tile of
`rows` rows (packed: rows / G query positions x G heads) computes whole key blocks up to its last
query position (seqlen_q == seqlen_k, bottom-right aligned); useful work is the causal triangle.

    python tile_model.py
"""
import math


def useful_share(rows: int, block_n: int, seqlen: int, group: int = 1) -> float:
    positions_per_tile = rows / group
    work = 0
    for tile in range(math.ceil(seqlen * group / rows)):
        last_position = min((tile + 1) * positions_per_tile, seqlen)
        work += rows * math.ceil(last_position / block_n) * block_n
    return group * seqlen * (seqlen + 1) / 2 / work


if __name__ == "__main__":
    print(f"{'seqlen':>6} {'192x128':>8} {'192x128 packed G4':>18} {'128x128':>8} {'128x128 packed G4':>18}")
    for seqlen in (1024, 2048, 4096, 8192, 16384):
        print(f"{seqlen:>6} {useful_share(192, 128, seqlen):8.3f} {useful_share(192, 128, seqlen, 4):18.3f} "
              f"{useful_share(128, 128, seqlen):8.3f} {useful_share(128, 128, seqlen, 4):18.3f}")
