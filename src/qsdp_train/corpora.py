"""The named built-in corpora: ``"shakespeare"`` (the default), ``"debian-docs"`` and
``"debian-large"``.

[Note: the debian-docs corpus]
About 24 M GPT-2 tokens of English technical prose, the HTML manuals of 11 Debian trixie
(``main``, ``binary-all``) documentation packages, one document per page (see ``debdocs.py`` for
the text rules, ``debcorpus.py`` for the build). Packages were chosen for prose: the kernel's
admin, driver and process guides, Python's library reference and HOWTOs, and the user guides,
tutorials and release notes of Django, SQLAlchemy, scikit-learn, pandas, SciPy, NumPy, Astropy,
OpenStack Neutron and Sphinx. Pages generated one per API object (``generated/``, ``api/``),
which are mostly signatures and parameter lists, are excluded by each pin's ``exclude``; measured
with this extractor that removes about 6.5 M tokens of listings. Nothing is mixed in from
outside Debian, so the corpus has one provenance and one set of pins. Each pin's ``license`` is
what the package's ``usr/share/doc/<package>/copyright`` states for the files it ships (all free
software licenses; the kernel's documentation is GPL-2). Val is 3% of the text, whole pages
(about 0.7 M tokens), so no page is in both splits.

[Note: the debian-large corpus]
About 468 M GPT-2 tokens (issue 34 asked for ten times debian-docs), all from Debian trixie
``binary-all`` packages: debian-docs' 11 manuals, 7 more (LLVM, Clang, CMake, Node.js, SymPy,
OpenStack Nova and Cinder; the same HTML rules), Perl's manual pages as POD source
(``perl-doc``), and the Linux kernel's source as Debian packages it (``linux-source-6.12``, the
same kernel as ``linux-doc-6.12``), one document per file, read out of the tarball nested in the
package (``debsource.py``). The kernel is 93% of it (a code corpus, C above all), so a model
trained on it is a code model that has also read manuals. Left out of the kernel:
``Documentation/`` (the same text as ``linux-doc-6.12``'s HTML, which is in the corpus),
amdgpu's generated register headers (``drivers/gpu/drm/amd/include/asic_reg/``: 476 MB of
``#define``, a third of the tree), perf's generated JSON event tables, image files (``.ppm``,
``.svg``), binaries, files over 1 MiB and hex data (see [Note: a source tree as documents]).
Licenses are each package's ``copyright`` file: the kernel GPL-2 (with parts under
GPL-2-compatible licenses its copyright lists; each file's ``SPDX-License-Identifier`` is
exact), the manuals free software licenses. Val is 1% of the text by document (4.8 M tokens).
Files of one driver or architecture share code by copy and pattern and can land in both
splits, so val loss on code measures in-distribution fit, not generalization.
"""

from __future__ import annotations

from .corpus import SHAKESPEARE, Sdist
from .debcorpus import DebCorpus
from .debdocs import DebPackage
from .debsource import DebSourceTree

__all__ = ["CORPORA", "DEBIAN_DOCS", "DEBIAN_LARGE", "get_corpus"]

_DOC = "usr/share/doc"

DEBIAN_DOCS = DebCorpus(
    name="debian-docs",
    description="HTML manuals of pinned Debian trixie documentation packages, one document "
    "per page (main content only)",
    val_fraction=0.03,
    min_chars=200,
    packages=(
        DebPackage(
            name="linux-doc-6.12",
            version="6.12.107-1",
            pool_path="pool/main/l/linux/linux-doc-6.12_6.12.107-1_all.deb",
            sha256="bc1d4603031c1f668f2189a9abb561a135c87f52b1f1ff93c05b1fe875275816",
            license="GPL-2 (Linux kernel documentation)",
            html_root=f"{_DOC}/linux-doc-6.12/html",
        ),
        DebPackage(
            name="python3.13-doc",
            version="3.13.5-2+deb13u5",
            pool_path="pool/main/p/python3.13/python3.13-doc_3.13.5-2+deb13u5_all.deb",
            sha256="a8a924637eeb25e666df5bbf7660ae09eb280be9effa39f9f6929e7a452bf65c",
            license="PSF-2.0 (Python Software Foundation License Version 2)",
            html_root=f"{_DOC}/python3.13/html",
        ),
        DebPackage(
            name="python-django-doc",
            version="3:4.2.28-0+deb13u2",
            pool_path="pool/main/p/python-django/python-django-doc_4.2.28-0+deb13u2_all.deb",
            sha256="76a48c3cfcfabbb44dca02cbe37b15920879252824bf990feb9d4ab820671a34",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-django-doc/html",
            main=("id", "yui-main"),
        ),
        DebPackage(
            name="python-sqlalchemy-doc",
            version="2.0.40+ds1-1",
            pool_path="pool/main/s/sqlalchemy/python-sqlalchemy-doc_2.0.40+ds1-1_all.deb",
            sha256="715be7ca412315bb53375697152eec4a41830b11a16369bd1894bb048795057a",
            license="Expat (MIT)",
            html_root=f"{_DOC}/python-sqlalchemy-doc/html",
        ),
        DebPackage(
            name="python-sklearn-doc",
            version="1.4.2+dfsg-8",
            pool_path="pool/main/s/scikit-learn/python-sklearn-doc_1.4.2+dfsg-8_all.deb",
            sha256="c213257d8f2afe711f3fdbe6b68560ea4587db580889de4cd1da0be5c1b1d071",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-sklearn-doc/html",
            exclude=r"^modules/generated/",
        ),
        DebPackage(
            name="python-pandas-doc",
            version="2.2.3+dfsg-9",
            pool_path="pool/main/p/pandas/python-pandas-doc_2.2.3+dfsg-9_all.deb",
            sha256="2416377a2e2338eed3854daaae92bb49feed2b08cb0e4a6ee1239011bfdc604a",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-pandas-doc/html",
            exclude=r"^(reference/api|generated)/",
        ),
        DebPackage(
            name="neutron-doc",
            version="2:26.0.3-0+deb13u3",
            pool_path="pool/main/n/neutron/neutron-doc_26.0.3-0+deb13u3_all.deb",
            sha256="c8d8da60f5463b6b5d83d90964516678277c2133c5a6caaa32795c2bf45629db",
            license="Apache-2.0",
            html_root=f"{_DOC}/neutron-doc/html",
        ),
        DebPackage(
            name="python-scipy-doc",
            version="1.15.3-1",
            pool_path="pool/main/s/scipy/python-scipy-doc_1.15.3-1_all.deb",
            sha256="27cab5010a6f182fcb9b29bf84b446f5f0e6c5664cb6c409a06fc4d901cb4da5",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-scipy-doc/html",
            exclude=r"^reference/generated/",
        ),
        DebPackage(
            name="python-numpy-doc",
            version="1:2.2.4+ds-1",
            pool_path="pool/main/n/numpy/python-numpy-doc_2.2.4+ds-1_all.deb",
            sha256="c995ee833e55da051faba4acc151a50f2c90a7ec6d7eafc868d294cbdea34952",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-numpy/html",
            exclude=r"(^|/)generated/",
        ),
        DebPackage(
            name="python-astropy-doc",
            version="7.0.1-3",
            pool_path="pool/main/a/astropy/python-astropy-doc_7.0.1-3_all.deb",
            sha256="6a0847a6253a9313cc9e166742cc7e1652e5c92a04f4d2cdb4b319f0bb50458e",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-astropy-doc/html",
            exclude=r"^api/",
        ),
        DebPackage(
            name="sphinx-doc",
            version="8.1.3-5",
            pool_path="pool/main/s/sphinx/sphinx-doc_8.1.3-5_all.deb",
            sha256="4292b5aeac24797cf862e09915ff1286ba8e7552362ca3fcbe213d1d5e460c66",
            license="BSD-2-Clause",
            html_root=f"{_DOC}/sphinx-doc/html",
        ),
    ),
)

DEBIAN_LARGE = DebCorpus(
    name="debian-large",
    description="The Linux kernel's source (one document per file) and the manuals of pinned "
    "Debian trixie packages (one document per page)",
    val_fraction=0.01,
    min_chars=200,
    packages=(
        *DEBIAN_DOCS.packages,
        DebSourceTree(
            name="linux-source-6.12",
            version="6.12.107-1",
            pool_path="pool/main/l/linux/linux-source-6.12_6.12.107-1_all.deb",
            sha256="775b9ef84d7fa7927ccebfec33fbbe9aeb2482ebf9a92c771aafd33fb6e2ee27",
            license="GPL-2 (Linux kernel; parts GPL-2+ or X11, LGPL-2.1, BSD-2-Clause, "
            "Unicode-data, Xen-interface as its copyright lists; per file: its SPDX line)",
            tarball="usr/src/linux-source-6.12.tar.xz",
            root="linux-source-6.12",
            exclude=r"^(Documentation|drivers/gpu/drm/amd/include/asic_reg|"
            r"tools/perf/pmu-events/arch)/|\.(ppm|svg)$",
        ),
        DebSourceTree(
            name="perl-doc",
            version="5.40.1-6+deb13u1",
            pool_path="pool/main/p/perl/perl-doc_5.40.1-6+deb13u1_all.deb",
            sha256="5199f0a0432ac3fac48d6e6a9e3a216d17977a49deff77dbdb958716fbe29b0c",
            license="GPL-1+ or Artistic (Perl's terms)",
            root="usr/share/perl/5.40.1/pod",
            include=r"\.pod$",
        ),
        DebPackage(
            name="llvm-19-doc",
            version="1:19.1.7-3",
            pool_path="pool/main/l/llvm-toolchain-19/llvm-19-doc_19.1.7-3_all.deb",
            sha256="3b77e2ad825b496437b9cd9db90f36d63ffb2e4817f96b04796eb8f589a86fca",
            license="Apache-2.0 WITH LLVM-exception",
            html_root=f"{_DOC}/llvm-19-doc/html",
            exclude=r"^AMDGPU/",
        ),
        DebPackage(
            name="clang-19-doc",
            version="1:19.1.7-3",
            pool_path="pool/main/l/llvm-toolchain-19/clang-19-doc_19.1.7-3_all.deb",
            sha256="70b162a39037a831ab0c757a100d385fcc649943e8ad08df5e9d8fa0133c0b69",
            license="Apache-2.0 WITH LLVM-exception",
            html_root=f"{_DOC}/clang-19/html",
        ),
        DebPackage(
            name="cmake-doc",
            version="3.31.6-2",
            pool_path="pool/main/c/cmake/cmake-doc_3.31.6-2_all.deb",
            sha256="3b9a5d0ea0e1a483a1055ea13a4ebca509c16e45fa276115fae8c206ac3bbb1b",
            license="BSD-3-Clause (cmake-data's copyright; cmake-doc's doc folder links there)",
            html_root=f"{_DOC}/cmake-data/html",
        ),
        DebPackage(
            name="nodejs-doc",
            version="20.19.2+dfsg-1+deb13u2",
            pool_path="pool/main/n/nodejs/nodejs-doc_20.19.2+dfsg-1+deb13u2_all.deb",
            sha256="8e236be96ae1ea7570c1dd7e903034820da3c03fd566528d388a2db641a65c21",
            license="Expat (MIT)",
            html_root=f"{_DOC}/nodejs/api",
            exclude=r"^all\.html$",
        ),
        DebPackage(
            name="python-sympy-doc",
            version="1.13.3-5",
            pool_path="pool/main/s/sympy/python-sympy-doc_1.13.3-5_all.deb",
            sha256="382d10f34621c834eaf493a84eb801d8496a19efdac3d1282806824ac046a857",
            license="BSD-3-Clause",
            html_root=f"{_DOC}/python-sympy-doc/html",
        ),
        DebPackage(
            name="nova-doc",
            version="2:31.0.0-6+deb13u2",
            pool_path="pool/main/n/nova/nova-doc_31.0.0-6+deb13u2_all.deb",
            sha256="0ac1bb83a0e3dc048b1630dcf47b3a9698f8600abe8d7b8c97737f0c5abb4eb5",
            license="Apache-2.0",
            html_root=f"{_DOC}/nova-doc/html",
        ),
        DebPackage(
            name="cinder-doc",
            version="2:26.0.0-2",
            pool_path="pool/main/c/cinder/cinder-doc_26.0.0-2_all.deb",
            sha256="fddd57b4a1e5d99e44e9c58c8c59161406556f196cb453dc3bab2a54d8c5e6cf",
            license="Apache-2.0",
            html_root=f"{_DOC}/cinder-doc/html",
            exclude=r"^contributor/api/",
        ),
    ),
)

#: Corpus name -> its pins. ``"shakespeare"`` is the default of ``prepare_data`` and ``qsdp train``.
CORPORA: dict[str, Sdist | DebCorpus] = {
    "shakespeare": SHAKESPEARE,
    "debian-docs": DEBIAN_DOCS,
    "debian-large": DEBIAN_LARGE,
}


def get_corpus(name: str) -> Sdist | DebCorpus:
    """The built-in corpus called ``name``.

    Args:
        name: one of ``CORPORA``.

    Returns:
        Its pins.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; use one of {sorted(CORPORA)}")
    return CORPORA[name]
