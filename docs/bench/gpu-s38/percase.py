# Per case, from bench results.json folders: median-of-repeats ratio, drafted, accepted, paused steps.
import json,statistics as st,sys,math
def load(d):
    r=json.load(open(d+'/results.json'))
    out={}
    for c in r['cases']:
        out.setdefault(c['id'],{})[c['mode']]=c
    return out
runs=sys.argv[1:]
R={d:load(d) for d in runs}
ids=list(R[runs[0]].keys())
print('case'.ljust(18)+''.join(d[-14:].rjust(30) for d in runs))
below={d:0 for d in runs}; logs={d:[] for d in runs}
for i in ids:
    row=i.ljust(18)
    for d in runs:
        c=R[d].get(i)
        if not c or 'ngram' not in c: row+=' '*30; continue
        p=st.median(c['plain']['decode_runs']); n=st.median(c['ngram']['decode_runs'])
        ratio=p/n; logs[d].append(math.log(ratio))
        if ratio<0.97: below[d]+=1
        g=c['ngram']
        row+=f"{ratio:6.2f}x d{g['drafted']:4d} a{g['accepted']:4d} p{g['paused_steps']:4d} ".rjust(30)
    print(row)
for d in runs:  # per-case geomean of the medians ratio, prompts below 0.97x, slowest
    print(d, 'geomean %.3f'%math.exp(st.mean(logs[d])), 'below', below[d], 'min %.3f'%math.exp(min(logs[d])))
