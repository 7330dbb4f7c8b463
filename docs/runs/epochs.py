"""Per-epoch records of a `capsnet train --val N` run and the validation rule that picks best.pt.

epochs(path) reads a metrics.jsonl and returns its epoch-end evaluations as {"val": {epoch: record}, "test":
{epoch: record}, "epochs": [epochs with both], "best": the epoch best.pt holds (best validation accuracy, ties:
the lower validation loss), "last": the last such epoch}, or None when no epoch has both. Imported by the
table.py scripts beside the runs' logs."""
import json


def epochs(path):
    recs = [json.loads(l) for l in open(path) if l.strip()]
    ev = lambda split: {round(r["epoch"]): r for r in recs if r.get("event") == "eval" and r["split"] == split}
    val, test = ev("val"), ev("test")
    both = sorted(set(val) & set(test))
    if not both:
        return None
    best = max(both, key=lambda e: (val[e]["accuracy"], -val[e]["loss"]))
    return {"val": val, "test": test, "epochs": both, "best": best, "last": both[-1]}
