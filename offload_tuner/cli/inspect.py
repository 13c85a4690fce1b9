"""`inspect`: hparams, tensor groups, bytes per group and per layer."""
from __future__ import annotations

import argparse

from ..app.inspect import inspect_model
from ..app.requests import InspectRequest
from planner.hardware import fmt_bytes
from .common import emit_json, add_positional, request


def cmd_inspect(args: argparse.Namespace) -> int:
    from planner.tables import inventory_summary, table
    o = inspect_model(request(InspectRequest, args))
    if args.json:
        emit_json(o.to_json())
        return 0
    inv = o.inv
    hp = inv.hparams
    groups = inv.groups()
    print(inventory_summary(inv))
    print(f"tensors: {len(inv.tensors)}; weights read per token: {fmt_bytes(inv.active_bytes_per_token())}"
          + ("; output tied to token_embd" if inv.tied_output else ""))
    print(f"n_embd {hp.n_embd}, n_head {hp.n_head}, n_head_kv {max(hp.n_head_kv)}, "
          f"head_dim {hp.head_dim_k}/{hp.head_dim_v}, "
          f"vocab {hp.n_vocab}, ctx_train {hp.n_ctx_train}"
          + (f", MLA kv_lora_rank {hp.mla_kv_lora_rank}" if hp.is_mla else "")
          + (f", SWA window {hp.n_swa} on {sum(hp.swa_layers)} layers" if hp.n_swa else ""))
    print()
    print(table(["group", "bytes"], [[g, fmt_bytes(b)] for g, b in sorted(groups.items(), key=lambda x: -x[1])]))
    print()
    runs: list[list[object]] = []
    for row in o.per_layer():
        desc = (fmt_bytes(row["bytes"]), fmt_bytes(row["expert_bytes"]), "nextn (not loaded)" if row["nextn"] else "")
        if runs and runs[-1][2:] == list(desc) and runs[-1][1] == row["layer"] - 1:
            runs[-1][1] = row["layer"]
        else:
            runs.append([row["layer"], row["layer"], *desc])
    print(table(["layers", "bytes per layer", "experts", "note"],
                [[f"{a}" if a == b else f"{a}-{b}", x, y, z] for a, b, x, y, z in runs]))
    return 0


def add_parser(sub) -> None:
    """Registers `inspect` and its options."""
    p = sub.add_parser("inspect", help="hparams, tensor groups, bytes per group and per layer")
    add_positional(p, InspectRequest, "model")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
