"""The one test template the whole spec runs through (see ``pytest_plugin``)."""

import pytest

from conformance.pytest_plugin import check_item


@pytest.mark.conformance
def test_conformance(conformance_item, conformance_session, request):
    backend, case, family = conformance_item
    check_item(conformance_session, backend, case, family, request.node)
