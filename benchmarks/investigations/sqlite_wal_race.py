"""Issue 37 follow-up: 6 processes open one new SQLite ledger file at once, 40 rounds; prints the rounds that failed."""
import multiprocessing as mp, os, tempfile, time
from qwen_vllm_ext.store.sqlite import Database

def opener(path, barrier, q):
    barrier.wait()
    try:
        Database(path); q.put("ok")
    except Exception as e:
        q.put(repr(e))

if __name__ == "__main__":
    fails = 0
    for trial in range(40):
        d = tempfile.mkdtemp(); path = os.path.join(d, "x.sqlite3")
        n = 6; b = mp.Barrier(n); q = mp.Queue()
        ps = [mp.Process(target=opener, args=(path, b, q)) for _ in range(n)]
        [p.start() for p in ps]; [p.join() for p in ps]
        res = [q.get() for _ in range(n)]
        bad = [r for r in res if r != "ok"]
        fails += bool(bad)
        if bad: print(trial, bad[0])
    print("trials with failure:", fails)
