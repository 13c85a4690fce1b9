"""inspect: hparams, tensor groups, bytes per group and per layer of one model."""
from __future__ import annotations

from dataclasses import dataclass

from planner.model import ModelInventory
from .requests import InspectRequest


@dataclass(frozen=True)
class InspectOutcome:
    """What `inspect` reports (the text printer, `--json` and the service read the same object)."""
    inv: ModelInventory

    def per_layer(self) -> list[dict]:
        out = []
        for il in range(self.inv.n_layer):
            ts = self.inv.by_layer.get(il, ())
            out.append({"layer": il, "bytes": sum(t.nbytes for t in ts),
                        "expert_bytes": sum(t.nbytes for t in ts if t.is_expert),
                        "nextn": any(t.role == "nextn" for t in ts)})
        return out

    def to_json(self) -> dict:
        inv = self.inv
        return {"model": inv.name, "source": inv.source, "arch": inv.arch,
                "hparams": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(inv.hparams).items()},
                "n_tensors": len(inv.tensors), "total_bytes": inv.total_bytes(),
                "active_bytes_per_token": inv.active_bytes_per_token(), "tied_output": inv.tied_output,
                "groups": inv.groups(), "layers": self.per_layer()}


def inspect_model(req: InspectRequest) -> InspectOutcome:
    from planner.loader import load_model
    return InspectOutcome(load_model(req.model))
