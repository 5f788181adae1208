"""A model of the sm90 backward's makespan per SM under three ways of handing out work items (one
key block of one (batch, KV head) each, bwd_sm90.cuh's bwd_cta order with the plan's causal
chunks): the hardware's (greedy, a CTA per item, with the per-CTA overhead the 12-07 timeline
measured, about 4.3 us), static turns of a persistent grid (item + grid) and a serpentine variant
of them (both with an assumed 1.5 us a item). A step costs 2.6 us. bf16, 16k tokens, hidden 2048.

    python schedule_model.py
"""
import heapq, math, sys
def bwd_cta(item, n_blocks, heads, batch, chunks):
    if chunks <= 0: return item % n_blocks, item // n_blocks % heads, item // n_blocks // heads
    pairs = heads*batch; small = pairs//chunks; larger = pairs % chunks
    larger_ctas = larger*(small+1)*n_blocks
    if item < larger_ctas:
        cp = small+1; fp = item//(cp*n_blocks)*cp
    else:
        cp = small; fp = larger*(small+1) + (item-larger_ctas)//(small*n_blocks)*small
    ic = item - fp*n_blocks; pair = fp + ic % cp
    return ic//cp, pair % heads, pair//heads
def sim(d, s, causal, sms=132, step=2.6, over_np=4.3, over_p=1.5):
    bm, bn = (128,128) if d==64 else (64,128)
    batch = 16384//s; heads = 2048//d; nb = -(-s//bn); mb = -(-s//bm)
    waves = 1.5; ppc = math.ceil(waves*sms/nb); chunks = max(1, batch*heads//ppc) if causal else 0
    items = nb*heads*batch
    lens = []
    for it in range(items):
        n,_,_ = bwd_cta(it, nb, heads, batch, chunks)
        mmin = (n*bn)//bm if causal else 0
        lens.append(mb - mmin)
    # greedy hardware
    h=[0.0]*sms; 
    for L in lens:
        t=heapq.heappop(h); heapq.heappush(h, t+L*step+over_np)
    greedy=max(h)
    per=[0.0]*sms
    for i,L in enumerate(lens): per[i%sms]+=L*step+over_p
    static=max(per)
    return greedy, static, sum(lens)*step/sms
for d in (64,128):
    for s in (1024,4096,16384):
        for c in (False,True):
            g,st,ideal=sim(d,s,c)
            print(f"d{d} s{s} causal={c}: greedy {g:.0f} static {st:.0f} ideal {ideal:.0f}  static/greedy {g/st:.3f}")
print("serpentine")
def sim2(d, s, causal, sms=132, step=2.6, over_np=4.3, over_p=1.5):
    bm, bn = (128,128) if d==64 else (64,128)
    batch = 16384//s; heads = 2048//d; nb = -(-s//bn); mb = -(-s//bm)
    ppc = math.ceil(1.5*sms/nb); chunks = max(1, batch*heads//ppc) if causal else 0
    items = nb*heads*batch
    lens = []
    for it in range(items):
        n,_,_ = bwd_cta(it, nb, heads, batch, chunks)
        lens.append(mb - ((n*bn)//bm if causal else 0))
    per=[0.0]*sms
    r=0
    while r*sms < items:
        for c in range(sms):
            it = r*sms + (sms-1-c if r%2 else c)
            if it < items: per[c]+=lens[it]*step+over_p
        r+=1
    return max(per)
for d in (64,128):
    for s in (1024,4096,16384):
        for c in (False,True):
            g,st,ideal=sim(d,s,c); sp=sim2(d,s,c)
            print(f"d{d} s{s} causal={c}: greedy {g:.0f} static {st:.0f} serp {sp:.0f} ideal {ideal:.0f}  serp/greedy {g/sp:.3f}")
