"""The audits' ``--data`` spec, torch-free: used by the CLI before torch is imported
(`tensoralg.audit.common`) and by the loader (`tensoralg.data.load_npz_data`)."""

from __future__ import annotations

__all__ = ["NPZ_ARRAYS", "check_data_spec"]

#: The arrays of an audit's ``--data npz:PATH`` file (`tensoralg.data.load_npz_data`).
NPZ_ARRAYS = ("X_train", "y_train", "X_test", "y_test")


def check_data_spec(spec: str, flag: str = "--data") -> str:
    """``digits`` or ``npz:PATH`` (the audits' ``--data``), returned unchanged; imports
    nothing heavy (the file itself is checked by `tensoralg.data.load_npz_data`).

    Raises:
        ValueError: anything else, in one line naming ``flag``.
    """
    if spec == "digits" or (isinstance(spec, str) and spec.startswith("npz:") and len(spec) > 4):
        return spec
    raise ValueError(f"{flag}: expected 'digits' or 'npz:PATH' (an .npz file with arrays "
                     f"{', '.join(NPZ_ARRAYS)}), got {spec!r}")
