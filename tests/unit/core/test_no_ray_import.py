import pkgutil
import subprocess
import sys

import narwhal_serve


def test_core_never_imports_ray() -> None:
    mods = [m.name for m in pkgutil.walk_packages(narwhal_serve.__path__, "narwhal_serve.")]
    assert len(mods) > 20
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'ray' or k.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"narwhal_serve imported: {out.stdout.strip()}"
