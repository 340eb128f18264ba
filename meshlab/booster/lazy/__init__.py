"""``LazyInitContext``, where Colossal-AI scripts import it from (``...lazy``)."""

from .lazy_init import LazyInitContext as LazyInitContext
