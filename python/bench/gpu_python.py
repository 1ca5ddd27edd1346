"""Python actors and tasks asking for a GPU, on a GPU host: placement, CUDA_VISIBLE_DEVICES,
and torch on the device inside a Regatta Python actor."""
import json, os, time
import regatta

regatta.init(num_gpus=1)
print("cluster", json.dumps(regatta.cluster_resources()), flush=True)


@regatta.remote(num_gpus=1)
class Gpu:
    def info(self):
        import torch
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = x @ x
        torch.cuda.synchronize()
        start = time.time()
        for _ in range(20):
            y = x @ x
        torch.cuda.synchronize()
        seconds = time.time() - start
        return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": torch.cuda.get_device_name(0),
                "bf16_tflops": round(20 * 2 * 8192 ** 3 / seconds / 1e12, 1), "pid": os.getpid()}


@regatta.remote(num_gpus=1)
def count_devices():
    import torch
    return torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")


gpu = Gpu.remote()
print("actor", json.dumps(regatta.get(gpu.info.remote(), timeout=240)), flush=True)
print("available while the actor holds the GPU", json.dumps(regatta.available_resources()), flush=True)
regatta.kill(gpu)
print("task", json.dumps(regatta.get(count_devices.remote(), timeout=240)), flush=True)
regatta.shutdown()
print("ok")
