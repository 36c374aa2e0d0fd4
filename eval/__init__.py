"""snapkv-bench evaluation tasks (LongBench, needle, RULER, ...) and their shared engine."""
from . import resolvers  # noqa: F401  (the config resolvers, before any config is composed)
from . import compressor_configs  # noqa: F401,E402  (compressor=<method>, from the methods' dataclasses)
from . import sections  # noqa: F401,E402  (the typed config sections, schema/<section>)
