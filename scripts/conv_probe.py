"""A probe, not a product path: the Gated DeltaNet short convolution (depthwise, causal, 4 taps, SiLU) written five
ways as one-op-family ONNX graphs in fp16, each timed on CUDA over d3-nano's shapes with inputs and outputs bound
on the device. `CausalConvWithState` took 7.9 of 75 GPU ms at 8 x 1000 in the thirteenth run, moving its tensor at
about a tenth of the H200's memory bandwidth (docs/gpu.md): this says whether another writing is faster.

    python scripts/conv_probe.py [--channels 6144] [--shapes 8x1000 32x200] [--repeats 50]

(6144 channels: query, key and value in one node, as the fused form had them until it wrote one node each: 2048.)
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from timing import bound_run_ms  # scripts/timing.py: this script runs as a file, its folder first on the path


def graphs(channels: int, taps: int) -> dict[str, object]:
    """Each writing of y = silu(causal depthwise conv(x)), x and y [B, L, C] fp16 (channels last)."""
    from onnx import TensorProto, helper, numpy_helper

    half = TensorProto.FLOAT16
    weight = np.random.default_rng(0).standard_normal((channels, 1, taps)).astype(np.float16) * 0.5
    x = helper.make_tensor_value_info("x", half, ["B", "L", channels])
    y = helper.make_tensor_value_info("y", half, ["B", "L", channels])
    ms = helper.make_opsetid("com.microsoft", 1)

    def model(nodes, inits, inputs=(x,), outputs=(y,)):
        graph = helper.make_graph(nodes, "conv", list(inputs), list(outputs), inits)
        # IR version 10: onnxruntime 1.31 refuses the newer one onnx's helper writes by default.
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), ms], ir_version=10)

    w = numpy_helper.from_array(weight, "w")
    made = {"causal_conv_with_state, channels last": model(
        [helper.make_node("CausalConvWithState", ["x", "w"], ["y", "state"], domain="com.microsoft", channels_last=1,
                          activation="silu")], [w])}
    xf = helper.make_tensor_value_info("x", half, ["B", channels, "L"])
    yf = helper.make_tensor_value_info("y", half, ["B", channels, "L"])
    made["causal_conv_with_state, channels first (no transposes timed)"] = model(
        [helper.make_node("CausalConvWithState", ["x", "w"], ["y", "state"], domain="com.microsoft", channels_last=0,
                          activation="silu")], [w], (xf,), (yf,))
    # cuDNN's grouped convolution in fp16, [B, C, 1, L] with the causal padding on the left, then SiLU.
    w4 = numpy_helper.from_array(weight.reshape(channels, 1, 1, taps), "w4")
    made["grouped Conv fp16 + transposes + QuickGelu"] = model([
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("Unsqueeze", ["xt", "two"], ["x4"]),
        helper.make_node("Conv", ["x4", "w4"], ["c4"], group=channels, pads=[0, taps - 1, 0, 0],
                         kernel_shape=[1, taps]),
        helper.make_node("Squeeze", ["c4", "two"], ["c"]),
        helper.make_node("Transpose", ["c"], ["ct"], perm=[0, 2, 1]),
        helper.make_node("QuickGelu", ["ct"], ["y"], domain="com.microsoft", alpha=1.0)],
        [w4, numpy_helper.from_array(np.array([2], np.int64), "two")])
    # The same grouped Conv between the transposes to and from channels first, in a session that prefers NHWC:
    # onnxruntime's layout pass then runs cuDNN's convolution channels last, and its transposes cancel ours.
    made["grouped Conv fp16, NHWC session (prefer_nhwc)"] = model([
        helper.make_node("Unsqueeze", ["x", "one"], ["x4"]),
        helper.make_node("Transpose", ["x4"], ["xt"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["xt", "w4"], ["c4"], group=channels, pads=[0, taps - 1, 0, 0],
                         kernel_shape=[1, taps]),
        helper.make_node("Transpose", ["c4"], ["ct"], perm=[0, 2, 3, 1]),
        helper.make_node("Squeeze", ["ct", "one"], ["c"]),
        helper.make_node("QuickGelu", ["c"], ["y"], domain="com.microsoft", alpha=1.0)],
        [w4, numpy_helper.from_array(np.array([1], np.int64), "one")])
    # Shifted products: x padded with K - 1 zero rows in front, K slices, K products, K - 1 sums, SiLU.
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"])]
    inits = [numpy_helper.from_array(np.array([0, taps - 1, 0, 0, 0, 0], np.int64), "pads")]
    terms = []
    for k in range(taps):
        inits += [numpy_helper.from_array(np.array([k], np.int64), f"s{k}"),
                  numpy_helper.from_array(np.array([-(taps - 1 - k) or np.iinfo(np.int64).max], np.int64), f"e{k}"),
                  numpy_helper.from_array(weight[:, 0, k].copy(), f"w{k}")]
        nodes += [helper.make_node("Slice", ["xp", f"s{k}", f"e{k}", "axis1"], [f"x{k}"]),
                  helper.make_node("Mul", [f"x{k}", f"w{k}"], [f"t{k}"])]
        terms.append(f"t{k}")
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    total = terms[0]
    for k, term in enumerate(terms[1:]):
        nodes.append(helper.make_node("Add", [total, term], [f"a{k}"]))
        total = f"a{k}"
    nodes.append(helper.make_node("QuickGelu", [total], ["y"], domain="com.microsoft", alpha=1.0))
    made["shifted products fp16 + QuickGelu"] = model(nodes, inits)
    return made


def time_graph(name: str, model, shape: tuple[int, int, int], repeats: int) -> tuple[float, np.ndarray]:
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # the CUDA and cuDNN libraries of the pip packages

    options = {"prefer_nhwc": "1"} if "prefer_nhwc" in name else {}
    session = ort.InferenceSession(model.SerializeToString(), providers=[("CUDAExecutionProvider", options)])
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float16)
    x_gpu = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", x_gpu)
    for output in session.get_outputs():  # y first, then the convolution's state where the op writes it
        binding.bind_output(output.name, "cuda")
    return bound_run_ms(session, binding, repeats, warmup=5), binding.copy_outputs_to_cpu()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, default=6144)  # d3-nano: 2 x 2048 (query, key) + 2048 (value)
    parser.add_argument("--taps", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", default=["8x1000", "32x200"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {}
    made = graphs(args.channels, args.taps)
    for text in args.shapes:
        batch, length = (int(v) for v in text.split("x"))
        report[text] = {}
        reference = None
        for name, model in made.items():
            channels_first = "channels first" in name
            shape = (batch, args.channels, length) if channels_first else (batch, length, args.channels)
            try:
                ms, y = time_graph(name, model, shape, args.repeats)
            except Exception as exc:  # the probe records what a writing cannot do
                report[text][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            entry = {"ms": round(ms, 4), "GB_per_s": round(2 * y.nbytes / ms / 1e6, 1)}
            if not channels_first:
                if reference is None:
                    reference = y.astype(np.float32)
                entry["max_abs_diff_vs_first"] = float(np.abs(y.astype(np.float32) - reference).max())
            report[text][name] = entry
            print(text, name, entry, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"channels": args.channels, "taps": args.taps, "repeats": args.repeats, "shapes": report}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
