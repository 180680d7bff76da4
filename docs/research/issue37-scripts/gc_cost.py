import time, gc, warnings, sys
warnings.simplefilter("ignore")
t = time.time()
import torch, torch.distributed
if len(sys.argv) > 1 and sys.argv[1] == "mcore":
    import megatron.core, megatron.core.models.gpt, megatron.core.optimizer, megatron.core.distributed
    from nvidia_resiliency_ext import inprocess
print(f"import {time.time() - t:.2f}s, objects {len(gc.get_objects())}")
for label in ("plain", "plain", "after gc.freeze()", "after gc.freeze()"):
    if label.startswith("after") and gc.get_freeze_count() == 0:
        gc.freeze()
    t = time.perf_counter(); n = gc.collect(); print(f"gc.collect() {label}: {1000 * (time.perf_counter() - t):.1f} ms (collected {n})")
