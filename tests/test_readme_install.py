"""The README's install advice: a CPU build of PyTorch for machines without a GPU, in step with CI."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_the_readme_says_how_to_install_a_cpu_build_of_pytorch_and_which_version_ci_tests():
    readme = _read("README.md")
    section = readme[readme.index("#### Installing PyTorch without CUDA"):]
    section = section[:section.index("\n#")]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in section
    assert 'pip install -e ".[torch]"' in section
    pinned = re.search(r'torch==([0-9.]+)', _read(".ci", "run")).group(1)  # what CI installs
    assert f'"torch=={pinned}" --index-url https://download.pytorch.org/whl/cpu' in section
    # Every place that advises the [torch] extra for the tests points to the CPU install.
    tests_advice = readme.index('(`pip install -e ".[torch]"`')
    assert "#installing-pytorch-without-cuda" in readme[tests_advice:tests_advice + 300]
