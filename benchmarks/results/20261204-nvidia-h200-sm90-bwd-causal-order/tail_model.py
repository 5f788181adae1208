"""Greedy list-scheduling model of the causal sm90 backward grid on 132 SMs (one CTA per SM):
CTA (batch, KV head, key block n) lasts qhpk x (query blocks - first query block of n) steps of c µs
plus o µs, dispatched in a given order to the first free SM; prints makespan / (total work / SMs) for
the launch order and for chunked orders (the step and per-CTA costs from the 2026-12-02 fits).
Exploration, kept for the record of how the chunk size was chosen; run with python3."""
import heapq
def run(order, dur, sms=132):
    h=[0.0]*sms; heapq.heapify(h); end=0
    for j in order:
        t=heapq.heappop(h); t2=t+dur[j]; end=max(end,t2); heapq.heappush(h,t2)
    return end
def grid(s, d, b, hkv, qhpk, bm=64, bn=128, c=2.24, o=4.0):
    mb=s//bm; nb=s//bn; dur={}
    for bb in range(b):
        for hh in range(hkv):
            for n in range(nb):
                mmin=(n*bn)//bm
                dur[(bb,hh,n)]=qhpk*(mb-mmin)*c+o
    return dur, nb
for s,b,h,qh in [(1024,16,16,1),(1024,16,4,4),(4096,4,16,1),(4096,4,4,4),(16384,1,16,1)]:
    dur,nb=grid(s,128,b,h,qh)
    cur=[(bb,hh,n) for bb in range(b) for hh in range(h) for n in range(nb)]
    lpt=sorted(cur,key=lambda k:-dur[k])
    total=sum(dur.values())/132
    # chunked: heads in chunks of G, n-major within chunk; chunks in order
    res={}
    for G in (8,16,32,64):
        heads=[(bb,hh) for bb in range(b) for hh in range(h)]
        o=[]
        for i in range(0,len(heads),G):
            ch=heads[i:i+G]
            o+= [(bb,hh,n) for n in range(nb) for (bb,hh) in ch]
        res[G]=run(o,dur)
    # current order but last chunk reversed?: LPT on the last 25% only
    print(s,b,h,qh,"ideal %.0f cur %.0f lpt %.0f"%(total,run(cur,dur),run(lpt,dur)), {k:round(v) for k,v in res.items()})
print("----")
cfg={64:(128,128,2.72,3.1),128:(64,128,2.24,4.0),192:(64,96,3.2,4.5),256:(64,64,2.6,4.5)}
for d,(bm,bn,c,o) in cfg.items():
  H=2048//d
  for s in (1024,4096,16384):
    b=16384//s
    for qh in (1,4):
      if d==192 and qh==4: continue
      hkv=H//qh
      dur,nb=grid(s,d,b,hkv,qh,bm,bn,c,o)
      cur=[(bb,hh,n) for bb in range(b) for hh in range(hkv) for n in range(nb)]
      total=sum(dur.values())/132
      res={}
      per_head=(s*d*8*qh + s*d*4)/2**20
      for G in (1,2,4,8,16,32):
        heads=[(bb,hh) for bb in range(b) for hh in range(hkv)]
        od=[]
        for i in range(0,len(heads),G):
            ch=heads[i:i+G]
            od+= [(bb,hh,n) for n in range(nb) for (bb,hh) in ch]
        res[G]=round(run(od,dur)/total,3)
      print(d,s,qh,"MB/head %.1f"%per_head,"cur %.3f"%(run(cur,dur)/total),res)
print("==== formulas")
import math
for d,(bm,bn,c,o) in cfg.items():
  H=2048//d
  for s in (1024,2048,4096,8192,16384):
    b=16384//s
    for qh in (1,4):
      if d==192 and qh==4: continue
      hkv=H//qh
      dur,nb=grid(s,d,b,hkv,qh,bm,bn,c,o)
      total=sum(dur.values())/132
      heads=[(bb,hh) for bb in range(b) for hh in range(hkv)]
      def chunked(G):
        od=[]
        for i in range(0,len(heads),G):
            ch=heads[i:i+G]
            od+= [(bb,hh,n) for n in range(nb) for (bb,hh) in ch]
        return round(run(od,dur)/total,3)
      cur=[(bb,hh,n) for bb in range(b) for hh in range(hkv) for n in range(nb)]
      f1=math.ceil(132/nb); f2=math.ceil(264/nb); f3=max(1,round(132/nb))
      print(d,s,qh,nb,"cur %.3f"%(run(cur,dur)/total),"ceil1",f1,chunked(f1),"ceil2",f2,chunked(f2),"round",f3,chunked(f3))
print("#### even chunks")
worst=[]
for d,(bm,bn,c,o) in cfg.items():
  H=2048//d
  for s in (1024,2048,4096,8192,16384, 3000, 1500):
    b=max(1,16384//s)
    for qh in (1,4):
      if d==192 and qh==4: continue
      hkv=H//qh
      dur,nb=grid(s,d,b,hkv,qh,bm,bn,c,o)
      total=sum(dur.values())/132
      heads=[(bb,hh) for bb in range(b) for hh in range(hkv)]
      P=len(heads)
      def even(Gmin):
        C=max(1,P//Gmin); od=[]
        for i in range(C):
            ch=heads[i*P//C:(i+1)*P//C]
            od+= [(bb,hh,n) for n in range(nb) for (bb,hh) in ch]
        return round(run(od,dur)/total,3)
      cur=[(bb,hh,n) for bb in range(b) for hh in range(hkv) for n in range(nb)]
      r={k:even(math.ceil(k*132/nb)) for k in (1,1.5,2,3)}
      worst.append((r,d,s,qh))
      print(d,s,qh,nb,"P",P,"cur %.3f"%(run(cur,dur)/total),r)
