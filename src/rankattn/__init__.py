"""rankattn: candidate-isolation attention for ranking transformers, on JAX."""

from rankattn.api import attention, available_impls, segment_ids_from_cu_seqlens
from rankattn.distributed import Sharding
from rankattn.errors import RankattnError, RankattnTypeError, RankattnValueError
from rankattn.planning import Plan, plan
from rankattn import serving  # registers the serving error codes (RA2xx)

__version__ = "0.1.0"

__all__ = ["attention", "available_impls", "plan", "Plan", "RankattnError", "RankattnTypeError",
           "RankattnValueError", "Sharding", "segment_ids_from_cu_seqlens"]
