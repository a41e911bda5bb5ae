import argparse, collections, glob, gzip, json, tempfile, jax, sys
from benchmarks import profile_step as ps
ps.use_model_xla_flags()
args=argparse.Namespace(config='../shared/bench/medium.json',batch=int(sys.argv[1]),active=None,mesh='1,1',prompt_len=32,greedy=False,runs=10,repo='.')
engine,state=ps.build(args)
for s in range(args.batch): engine.kv.grow(s, 60)
tables=engine.kv.table()
step=engine._generate.lower(engine.params,state,tables).compile()
names=ps.instructions(step.as_text())
for _ in range(3): state=jax.block_until_ready(step(engine.params,state,tables)[0])
with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
        for _ in range(10): state=jax.block_until_ready(step(engine.params,state,tables)[0])
    tr=json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz",recursive=True)[0]))
th=[(n,t) for n,t in ps.self_times(tr["traceEvents"]) if n.removesuffix(".clone") in names]
tot=collections.Counter()
for n,t in th:
    c=ps.categorise(n,names); key=(c,names[n.removesuffix(".clone")][-100:]); tot[key]+=t
for (c,op),t in tot.most_common(40):
    if 'moe' in c: continue
    print(round(t/10/1e3,3), c[:20], op)
