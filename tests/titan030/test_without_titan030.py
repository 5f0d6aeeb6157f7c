"""Where torchtitan 0.2.2 is installed (the project's main environment): the library and its 0.2.2
integration import as before, and only the 0.3.0 adapter refuses, saying how to get 0.3.0. (The
adapter raises ImportError here, so a library module that imported it would fail to import.)"""

from __future__ import annotations

import importlib
from importlib.metadata import version

import pytest

if version("torchtitan") == "0.3.0":
    pytest.skip("runs where torchtitan 0.2.2 is installed (the main environment)", allow_module_level=True)


@pytest.mark.parametrize("module", ["mxfp8_ep", "mxfp8_ep.dispatcher", "mxfp8_ep.titan022"])
def test_library_imports_with_torchtitan_022(module):
    importlib.import_module(module)


def test_adapter_says_it_needs_torchtitan_030():
    with pytest.raises(ImportError, match=r"torchtitan 0\.3\.0.*has torchtitan 0\.2\.2.*install\.sh --torchtitan "
                                          r"0\.3\.0.*setup_titan030\.sh"):
        import mxfp8_ep.titan030  # noqa: F401
