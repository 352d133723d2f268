import json,statistics as st,sys
def load(d):
    r=json.load(open(d+"/results.json")); out={}
    for c in r["cases"]:
        out.setdefault(c["id"],{}).setdefault(c["mode"],c)
    return r,out
for d in sys.argv[1:]:
    r,cs=load(d)
    rows=[]
    for cid,m in cs.items():
        p=m["plain"]; n=m["ngram"]
        pr=p["decode_runs"]; nr=n["decode_runs"]
        med=st.median(pr)/st.median(nr)
        paired=st.median([a/b for a,b in zip(pr,nr)])
        rows.append((med,paired,cid,n["drafted"],n["accepted"],n.get("paused_steps"),n["passes"],n["tokens"]))
    rows.sort()
    below=[x for x in rows if x[0]<0.97]; belowp=[x for x in rows if x[1]<0.97]
    print(d,"n",len(rows),"below med",len(below),"paired",len(belowp),"paused total",sum(x[5] or 0 for x in rows))
    for x in rows[:7]: print("  %.2f %.2f %-16s drafted %5d acc %4d paused %s passes %d"%x[:7])
