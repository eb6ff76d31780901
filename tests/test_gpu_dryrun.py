"""The CUDA dry-run's recorder (meshfold/gpucheck.py), in one process: each kind of host
sync is found and placed, and host tensors mixed into device computations are errors.

The fake-CUDA matrix over every layout (issue #26 item 2) is not in the suite yet: at the
merge it failed in one world-4 case with "ranks list must not contain duplicate entries"
(the recorder answering reads of fake tensors that carry real mesh values); its cases are in
the history of this file (branch gpudry) and docs/gpu.md.
"""


class _Layer(__import__("torch").nn.Module):
    def forward(self, x):
        import torch

        n = int(x.sum())  # a scalar read inside a layer
        torch.bincount(x.long().flatten(), minlength=4)
        y = x[x > 0]  # boolean-mask indexing
        host = torch.ones(x.shape[-1])  # made without device=: a host tensor on a GPU run
        return (x * host).sum() + n + y.numel()


def test_recorder_names_syncs_layers_and_host_tensors():
    """In-process: each kind of host sync is found inside the layer, and a host tensor mixed
    into a device computation is an error; a host scalar is not. (Places name meshfold
    frames; this test's layer is not one, so they read "torch (no meshfold frame)".)"""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshfold import gpucheck
    from meshfold.comm import HostTensorMode

    layer = _Layer()
    with FakeTensorMode(), gpucheck.recording(layer_modules=[layer]) as rec:
        x = torch.randn(4, 8)  # made before the step: a device tensor (the batch)
        with HostTensorMode():
            layer(x)
            x * torch.tensor(2.0)  # a host scalar: fine on CUDA
        syncs = rec.pop_step()["syncs"]
    kinds = {k.split(" (")[-1].rstrip(")") for k in syncs}
    assert kinds == {"scalar read", "bincount", "boolean-mask indexing"}, syncs
    assert len(rec.errors) == 1 and "host tensor torch.float32[8]" in rec.errors[0], rec.errors
    assert len(rec.in_layer) == 3, rec.in_layer
