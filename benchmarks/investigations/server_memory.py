"""Issue 37: memory one test server takes (MemAvailable before and after it is healthy), 1 GiB of KV cache.
usage: .venv/bin/python benchmarks/investigations/server_memory.py [launcher flags...]"""
import time, psutil, sys, os
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
from qwen_vllm_ext.bench.server import ServeProcess
def avail(): return psutil.virtual_memory().available / 2**30
a0 = avail()
args = sys.argv[1:]
s = ServeProcess(args, "/tmp/memprobe.log")
s.wait_healthy(); time.sleep(3)
a1 = avail()
print(f"{args}: available drop {a0 - a1:.2f} GiB")
s.stop()
