"""A probe, not a product path: onnxruntime's `GatedDeltaNet` node alone, as the CUDA form's d3 text graph writes it
(rank-4 uniform packing, fp16 query/key/value, fp32 decay inputs and state, Qwen gate, sigmoid update rate,
L2-normalised query and key, zero initial state), at d3-nano's shapes, timed on CUDA with inputs and outputs bound on
the device, and checked against the recurrence in float64:

- on random inputs, and on a run of one repeated token (every position the same query, key, value and gate inputs),
  which made the portable graph's old chunk solve cancel (docs/gpu.md, "Fourteenth run");
- with the `chunk_size` attribute at 64 (the default) and 32, and with each engine `ORT_GDN_PLAN` pins (each in a
  process of its own: onnxruntime reads the variable where it plans).

    python scripts/gdn_probe.py [--heads 16] [--shapes 1x200 32x200 8x1000] [--repeats 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from timing import bound_run_ms  # scripts/timing.py: this script runs as a file, its folder first on the path

DIM = 128  # the chunked engine's only head size
PLANS = ("", "chunked", "chunked_split", "recurrent")  # "" = onnxruntime's own choice


def model(chunk_size: int | None):
    from onnx import TensorProto, helper

    half, fp32 = TensorProto.FLOAT16, TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(name, half, ["B", "L", "H", DIM]) for name in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(name, fp32, ["B", "L", "H"]) for name in ("a", "b")]
    inputs += [helper.make_tensor_value_info("state", fp32, ["B", "H", DIM, DIM]),
               helper.make_tensor_value_info("a_log", fp32, ["H"]), helper.make_tensor_value_info("dt_bias", fp32, ["H"])]
    attributes = dict(update_rule="gated_delta", gate_activation="qwen", beta_activation="sigmoid", qk_l2_norm=1,
                      scale=DIM ** -0.5)
    if chunk_size is not None:
        attributes["chunk_size"] = chunk_size
    node = helper.make_node("GatedDeltaNet", ["q", "k", "v", "", "a", "b", "state", "a_log", "dt_bias"], ["o"],
                            domain="com.microsoft", **attributes)
    graph = helper.make_graph([node], "gdn", inputs, [helper.make_tensor_value_info("o", half, ["B", "L", "H", DIM])])
    # IR version 10: onnxruntime 1.31 refuses the newer one onnx's helper writes by default.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def feeds(batch: int, length: int, heads: int, repeated: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    steps = 1 if repeated else length

    def draw(*shape):
        x = rng.standard_normal((batch, steps, *shape)).astype(np.float32)
        return np.ascontiguousarray(np.broadcast_to(x, (batch, length, *shape)))

    return {"q": draw(heads, DIM).astype(np.float16), "k": draw(heads, DIM).astype(np.float16),
            "v": draw(heads, DIM).astype(np.float16), "a": draw(heads), "b": draw(heads),
            "state": np.zeros((batch, heads, DIM, DIM), np.float32),
            "a_log": rng.uniform(-1, 1, heads).astype(np.float32), "dt_bias": rng.uniform(-1, 1, heads).astype(np.float32)}


def recurrence(x: dict[str, np.ndarray], rows: int) -> np.ndarray:
    """The gated delta rule in float64, per value head, state V-major [Dv, Dk], for the first `rows` rows."""
    q, k, v = (x[n][:rows].astype(np.float64) for n in ("q", "k", "v"))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    gate = -np.exp(x["a_log"].astype(np.float64)) * np.logaddexp(0, x["a"][:rows] + x["dt_bias"])  # softplus
    beta = 1 / (1 + np.exp(-x["b"][:rows].astype(np.float64)))
    state = np.zeros((rows, q.shape[2], DIM, DIM))
    out = np.empty_like(v)
    for t in range(q.shape[1]):
        state *= np.exp(gate[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhvk,bhk->bhv", state, k[:, t]))
        state += delta[..., :, None] * k[:, t, :, None, :]
        out[:, t] = DIM ** -0.5 * np.einsum("bhvk,bhk->bhv", state, q[:, t])
    return out


def run_case(shape: str, heads: int, chunk_size: int | None, repeats: int, check_rows: int) -> dict:
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    # CUDA where onnxruntime has it; the CPU kernel otherwise (a check of the probe itself, not of the GPU's engines).
    device = "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    session = ort.InferenceSession(model(chunk_size).SerializeToString(),
                                   providers=["CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"])
    batch, length = (int(v) for v in shape.split("x"))
    check_rows = min(check_rows, batch)
    result = {}
    for case, repeated in (("random", False), ("repeated token", True)):
        x = feeds(batch, length, heads, repeated)
        binding = session.io_binding()
        for name, value in x.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, 0))
        binding.bind_output("o", device)
        ms = bound_run_ms(session, binding, repeats)
        got = binding.copy_outputs_to_cpu()[0][:check_rows].astype(np.float64)
        want = recurrence(x, check_rows)
        result[case] = {"device": device, "ms": round(ms, 4), "finite": bool(np.isfinite(got).all()),
                        "max_abs_diff": float(np.abs(got - want).max()), "max_abs_ref": float(np.abs(want).max())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)  # d3-nano: 16 query/key and 16 value heads of 128
    parser.add_argument("--shapes", nargs="+", default=["1x200", "32x200", "8x1000"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--check-rows", type=int, default=1, help="rows checked against the float64 recurrence")
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "SHAPE,CHUNK": one case, in this process (JSON on stdout)
    args = parser.parse_args()
    if args.one:
        shape, chunk = args.one.split(",")
        print(json.dumps(run_case(shape, args.heads, int(chunk) if chunk else None, args.repeats, args.check_rows)))
        return
    report = []
    for plan in PLANS:
        env = {**os.environ, "ORT_GDN_PLAN": plan} if plan else {k: v for k, v in os.environ.items()
                                                                 if k != "ORT_GDN_PLAN"}
        for chunk in ("", "32") if not plan else ("",):  # the narrow chunk under onnxruntime's own plan only
            for shape in args.shapes:
                row = {"plan": plan or "default", "chunk_size": int(chunk) if chunk else 64, "shape": shape}
                done = subprocess.run([sys.executable, __file__, "--one", f"{shape},{chunk}", "--heads", str(args.heads),
                                       "--repeats", str(args.repeats), "--check-rows", str(args.check_rows)],
                                      env=env, capture_output=True, text=True)
                if done.returncode == 0:
                    row.update(json.loads(done.stdout.strip().splitlines()[-1]))
                else:
                    row["error"] = done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else "failed"
                report.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"heads": args.heads, "head_dim": DIM, "repeats": args.repeats, "cases": report}, fh, indent=1)


if __name__ == "__main__":
    main()
