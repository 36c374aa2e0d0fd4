"""One compression method a file. Importing this package imports every module of its folder, and each
registers its method (``snapkv.registry``): a new method is its file, nothing else."""
import importlib
import pkgutil

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
