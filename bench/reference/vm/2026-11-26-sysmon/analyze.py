# Tables of perthread.sh's output: per contender, job and round, CPU per
# I/O, sysmon's wake-ups and CPU per I/O, and the NBD side's CPU (our Go
# threads, or rbd-nbd's reader and writer). Usage: analyze.py OUT
import csv, collections, sys, os
d=sys.argv[1]
rows=[l.strip().split(',') for l in open(os.path.join(d,'summary.txt')) if not l.startswith('#') and l.strip()]
print("contender job round iops cpu_us/io sysmon_wakes/io sysmon_us/io nbd_side_us/io")
for c,j,rnd,iops,cpu,*_ in rows:
    st=os.path.join(d,f'{c}-{j}-{rnd}.stat'); sc=os.path.join(d,f'{c}-{j}-{rnd}.sc')
    if not os.path.exists(st): continue
    ios=float(iops)*12
    th={}; csw={}
    for l in open(st):
        f=l.strip().split(',')
        if len(f)>3:
            try: v=float(f[1])
            except: continue
            if f[3]=='task-clock': th[f[0]]=v
            if f[3]=='context-switches': csw[f[0]]=v
    sm=None
    if os.path.exists(sc):
        ns=collections.Counter(l.split()[0] for l in open(sc) if l.split()[1:]==['35'])
        if ns:
            tid=ns.most_common(1)[0][0]; m=[k for k in th if k.endswith('-'+tid)]; sm=m[0] if m else None
    if sm is None and c!='ceph':
        # Never seen in nanosleep: take the first Go thread that ran,
        # which is sysmon (internal/sysmon: the first thread made after
        # the main one, and the main thread sleeps); marked "?".
        cands=[k for k in th if k.startswith('rbd-nbd-go') and csw.get(k,0)>0]
        sm=min(cands,key=lambda k:int(k.rsplit('-',1)[1])) if cands else None
        sm_note='?'
    else: sm_note=''
    nbd=sum(v for k,v in th.items() if k.startswith(('rbd-nbd-go','rbd_reader','rbd_writer')))*1e3/ios
    print(f"{c} {j} {rnd} {iops} {cpu} {csw.get(sm,0)/ios if sm else 0:.2f}{sm_note} {th.get(sm,0)*1e3/ios if sm else 0:.0f} {nbd:.0f}")
