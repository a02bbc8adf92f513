"""``qkv doctor``: where qkv's CPU speed paths stand on this machine, and why any of them is off."""

from __future__ import annotations

import json
from typing import Annotated

import torch
import typer

__all__ = ["register", "doctor", "report"]


def report() -> dict:
    """What ``qkv doctor`` shows, as a dict: the compiled kernels (state prebuilt / jit / off, the capability
    built for, the library, why off, why a prebuilt library was passed over), this CPU's capability, torch's
    version, threads (and how many a model step takes now, beside the other runnable tasks), oneDNN and the int8
    head screen (each with the reason it is off, or None), and how int8 weights are asked for (never a default)
    and whether their kernel runs."""
    from qkv.cpu import kernels, threads
    from qkv.cpu.gemm import onednn_unavailable_reason
    from qkv.cpu.greedy import screen_unavailable_reason

    st = kernels.status()
    return {
        "kernels": {"state": st.state, "capability": st.capability, "library": st.path, "off_because": st.reason,
                    "prebuilt_passed_over_because": st.note},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
                    "other_runnable_now": threads.others_running(fresh=True), "step_now": threads.step_threads(),
                    "how": 'an optimized model\'s step uses no more threads than cores are free; '
                           'qkv.cpu.optimize(model, threads="fixed") keeps torch\'s setting'},
        "onednn": {"on": onednn_unavailable_reason() is None, "off_because": onednn_unavailable_reason()},
        "int8_head_screen": {"on": screen_unavailable_reason() is None, "off_because": screen_unavailable_reason()},
        "int8_weights": {"default": False, "how": 'qkv.cpu.optimize(model, weights="int8")',
                         "kernel_on": st.reason is None, "kernel_off_because": st.reason},
        "bf16_exact_weights": {"default": False, "how": 'qkv.cpu.optimize(model, weights="bf16-exact")',
                               "kernel_on": st.reason is None, "kernel_off_because": st.reason},
    }


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")] = False,
) -> None:
    """Show where qkv's CPU speed paths stand here: the compiled kernels (prebuilt from the wheel, built by JIT at
    first use, or off, and why), the CPU capability they were built for, torch's version and threads, oneDNN and
    the int8 screen of greedy heads, each with the reason it is off.

    Examples:

        qkv doctor

        qkv doctor --json
    """
    info = report()
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    k = info["kernels"]
    where = {"prebuilt": "prebuilt (shipped in the installed package)", "jit": "built by JIT at first use",
             "off": "off"}[k["state"]]
    lines = [f"compiled kernels: {where}"]
    if k["library"]:
        lines.append(f"  library: {k['library']}")
    lines.append(f"  built for: {k['capability']}")
    if k["off_because"]:
        lines.append(f"  off because: {k['off_because']}")
    if k["prebuilt_passed_over_because"]:
        lines.append(f"  prebuilt library not used: {k['prebuilt_passed_over_because']}")
    lines += [f"cpu capability: {info['cpu_capability']}", f"torch: {info['torch']}",
              f"threads: {info['threads']['intra_op']} intra-op, {info['threads']['inter_op']} inter-op",
              f"  a step now: {info['threads']['step_now']} (other runnable tasks: "
              f"{info['threads']['other_runnable_now']}; {info['threads']['how']})"]
    for name, key in (("oneDNN products", "onednn"), ("int8 head screen", "int8_head_screen")):
        part = info[key]
        lines.append(f"{name}: {'on' if part['on'] else 'off'}" + ("" if part["on"] else
                                                                   f" ({part['off_because']})"))
    w = info["int8_weights"]
    lines.append("int8 weights (lossy): never by default, " + w["how"] + " quantizes a model's linear layers"
                 + ("" if w["kernel_on"] else f" (cannot run here: {w['kernel_off_because']})"))
    w = info["bf16_exact_weights"]
    lines.append("bf16-exact weights (lossless): not by default, " + w["how"] + " holds float32 weights of "
                 "bfloat16 values (a bf16 checkpoint loaded as float32) in bfloat16"
                 + ("" if w["kernel_on"] else f" (cannot run here: {w['kernel_off_because']})"))
    typer.echo("\n".join(lines))


def register(app: typer.Typer) -> None:
    """Add ``doctor`` to ``app``."""
    app.command("doctor")(doctor)
