"""Gefen's state layouts as contracts, and the refusal when a state of one meets the other.
Torch-free, so gefen_ckpt can check a layout without importing the optimizer.
"""

from __future__ import annotations

from gefen.contract import FieldSpec, OptimizerContract

__all__ = ["CONTRACTS", "MOMENTS", "V_CODEBOOK", "version_refusal"]

#: the compressed first moment (8-bit codes, one scale per block) that m8 and GefenMuon keep
MOMENTUM_FIELDS = (
    FieldSpec("step", "int64", "scalar"),
    FieldSpec("period", "int64", "scalar"),
    FieldSpec("m_code", "uint8", "param"),
    FieldSpec("m_scale", "float32", "block"),
)
CODEBOOK_FIELD = FieldSpec("codebook", "float32", "global")
_M8_FIELDS = (
    *MOMENTUM_FIELDS,
    FieldSpec("v", "float32", "block", optional=True),
    FieldSpec("v_row", "float32", "row", optional=True),
    FieldSpec("v_col", "float32", "col", optional=True),
)
_M4V4_FIELDS = (
    FieldSpec("step", "int64", "scalar"),
    FieldSpec("mv_code", "uint8", "param", optional=True),
    FieldSpec("m_row_scale", "bfloat16", "row", optional=True),
    FieldSpec("v_row", "float32", "row", optional=True),
    FieldSpec("v_col", "float32", "col", optional=True),
    FieldSpec("exp_avg", "bfloat16", "param", optional=True),  # 1-D/0-D: stochastically rounded
    FieldSpec("exp_avg_sq", "float32", "param", optional=True),
)
_HYPER = ("lr", "betas", "eps", "weight_decay", "factored_v_2d")
#: the state layouts: ``moments=`` value -> its contract, the default first (version "1": ``moments="m8"``)
CONTRACTS = {
    "m4v4": OptimizerContract(implementation="gefen.Gefen", version="2",
                              hyperparameters=(*_HYPER, "moments", "seed"), fields=_M4V4_FIELDS,
                              global_fields=(CODEBOOK_FIELD, FieldSpec("v_codebook", "float32", "global"))),
    "m8": OptimizerContract(implementation="gefen.Gefen", version="1", hyperparameters=_HYPER, fields=_M8_FIELDS,
                            global_fields=(CODEBOOK_FIELD,)),
}
MOMENTS = tuple(CONTRACTS)
V_CODEBOOK = "v_codebook"


def version_refusal(saved_version: str, live_version: str) -> str | None:
    """The one-line refusal for gefen.Gefen state of contract ``saved_version`` offered to a Gefen
    whose contract is ``live_version`` (None: the layouts agree)."""
    if saved_version == live_version:
        return None
    live_moments = next(m for m, c in CONTRACTS.items() if c.version == live_version)
    saved = next((m for m, c in CONTRACTS.items() if c.version == saved_version), None)
    if saved is None:
        return (f"gefen.Gefen state of contract version {saved_version!r} is unknown to this Gefen (it reads "
                f"{', '.join(repr(c.version) for c in CONTRACTS.values())}): a newer library wrote it?")
    return (f"gefen.Gefen state of contract version {saved_version!r} (moments={saved!r}) does not load into "
            f"Gefen(moments={live_moments!r}) (version {live_version!r}): construct Gefen(..., moments={saved!r}) to "
            f"load it as it is, or convert it: gefen-ckpt convert SRC DST --into Gefen"
            + ("" if live_moments == "m4v4" else " --moments m8"))
