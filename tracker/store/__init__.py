"""The deadline store: SQLAlchemy models, the one manager that touches the database."""

from .manager import Store
from .store_errors import Fenced, StoreUnavailable

__all__ = ["Fenced", "Store", "StoreUnavailable"]
