"""The install advice: a CPU build of PyTorch for machines without a GPU, in step with CI.

The advice is in docs/pytorch.md ("Installing PyTorch without CUDA"); README.md and CONTRIBUTING.md
point to it wherever they advise the [torch] extra.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADVICE = "docs/pytorch.md#installing-pytorch-without-cuda"


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_the_docs_say_how_to_install_a_cpu_build_of_pytorch_and_which_version_ci_tests():
    page = _read("docs", "pytorch.md")
    section = page[page.index("## Installing PyTorch without CUDA"):]
    section = section[:section.index("\n#")]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in section
    assert 'pip install -e ".[torch]"' in section
    pinned = re.search(r'torch==([0-9.]+)', _read(".ci", "run")).group(1)  # what CI installs
    assert f'"torch=={pinned}" --index-url https://download.pytorch.org/whl/cpu' in section
    # Every place that advises the [torch] extra for the tests points to the CPU install.
    contributing = _read("CONTRIBUTING.md")
    tests_advice = contributing.index('(`pip install -e ".[torch]"`')
    assert ADVICE in contributing[tests_advice:tests_advice + 300]
    # And so does the README's install section, where the extras are listed.
    readme = _read("README.md")
    extra = readme.index("| `torch` |")
    assert ADVICE in readme[extra:readme.index("\n", extra)]
