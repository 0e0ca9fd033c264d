"""The deadline store: SQLAlchemy models, the one manager that touches the database."""

from .errors import Fenced, StoreUnavailable
from .manager import Store

__all__ = ["Fenced", "Store", "StoreUnavailable"]
