"""BatchEncoding: what a tokenizer call returns, a dict of token lists that turns into tensors.

Offers: BatchEncoding.
"""

from __future__ import annotations

from collections.abc import Mapping


class BatchEncoding(dict):
    """What a tokenizer call returns: a dict (`input_ids`, `attention_mask`, ...) that also reads as attributes.

    `encodings` holds the `tokenizers.Encoding` of each row (offsets, word ids) when the call made them.
    """

    def __init__(self, data: Mapping | None = None, encodings: list | None = None, tensor_type: str | None = None):
        super().__init__(data or {})
        self.encodings = encodings
        if tensor_type is not None:
            self.convert_to_tensors(tensor_type)

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"BatchEncoding has no field {name!r}; it holds: {', '.join(self) or 'nothing'}"
            ) from None

    def tokens(self, batch_index: int = 0) -> list[str]:
        if not self.encodings:
            raise ValueError(
                "tokens() needs the encodings of a tokenizer call; this BatchEncoding was built without them"
            )
        return self.encodings[batch_index].tokens

    def convert_to_tensors(self, tensor_type: str | None) -> "BatchEncoding":
        """Turn every list value into a `torch.Tensor` ("pt") or a `numpy.ndarray` ("np"), in place."""
        if tensor_type is None:
            return self
        if tensor_type not in ("pt", "np"):
            raise ValueError(f'return_tensors "{tensor_type}" is not one of: pt, np (or None for Python lists)')
        import numpy as np

        for key, value in self.items():
            if hasattr(value, "shape"):
                continue
            rows = value if value and isinstance(value[0], (list, tuple)) else None
            ragged = rows is not None and len({len(row) for row in rows}) > 1
            # Values keep their shape, as in transformers: tokenizer calls hand over rows already, and a
            # per-row value (length, overflow_to_sample_mapping) is one number per row, a (batch,) tensor.
            if tensor_type == "pt":
                import torch

                if ragged:
                    raise ValueError(
                        f"Unable to create a tensor from {key!r}: its rows have different lengths "
                        f"({sorted({len(row) for row in rows})}). Pass padding=True (and truncation=True) to get "
                        "rows of the same length."
                    )
                # An empty batch has no values to infer a dtype from; ids are integers (as below for numpy).
                tensor = torch.tensor(value)
                self[key] = tensor.long() if tensor.numel() == 0 else tensor
            elif ragged:
                # numpy holds rows of different lengths as an object array of int arrays, as transformers does.
                self[key] = np.asarray([np.asarray(row) for row in rows], dtype=object)
            else:
                array = np.asarray(value)
                self[key] = array.astype(np.int64) if array.size == 0 else array
        return self

    def to(self, device, non_blocking: bool = False) -> "BatchEncoding":
        """Move every tensor to `device` (a torch.device, a string like "cuda:0", or an int); returns self."""
        import torch

        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device, non_blocking=non_blocking)
        return self
