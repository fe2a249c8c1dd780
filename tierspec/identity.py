"""What a routing mask, a judge head or a draft head records about the model it was made for,
so that applying it to another model is refused."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelIdentity:
    """What a routing mask or judge head records to refuse being applied to another model."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    content_hash: str  # sha256 of the weights' source file(s); "" when unknown

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def matches(self, other: "ModelIdentity") -> bool:
        same_shape = (self.num_layers, self.hidden_size, self.vocab_size) == (
            other.num_layers,
            other.hidden_size,
            other.vocab_size,
        )
        if not same_shape:
            return False
        if self.content_hash and other.content_hash:
            return self.content_hash == other.content_hash
        return self.name == other.name

    def mismatch(self, other: "ModelIdentity") -> str:
        """Why ``other`` is not this model, as the end of a sentence starting "... was made for"."""
        if (self.num_layers, self.hidden_size, self.vocab_size) != (other.num_layers, other.hidden_size, other.vocab_size):
            return (f"was made for model '{self.name}' ({self.num_layers} layers, hidden {self.hidden_size}, vocabulary "
                    f"{self.vocab_size}), not for '{other.name}' ({other.num_layers} layers, hidden {other.hidden_size}, "
                    f"vocabulary {other.vocab_size})")
        if self.content_hash and other.content_hash and self.content_hash != other.content_hash:
            return (f"was made for other weights than those loaded ('{self.name}' with weights {self.content_hash[:12]}…, "
                    f"loaded '{other.name}' with weights {other.content_hash[:12]}…)")
        return f"was made for model '{self.name}', not for '{other.name}'"
