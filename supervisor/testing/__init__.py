"""Test support shipped with the package: in-memory fakes of the profile and browser seams.

Nothing in the product imports this package; tests and contract suites do
(`from sfguard.supervisor.testing import FakeProfileLease`, ...).
"""
from sfguard.supervisor.testing.browsers import FakeBrowserHost, FakeHandoff, FakePipe
from sfguard.supervisor.testing.fakes import (
    FakeAuditSink,
    FakeKeyProvider,
    FakeLeaseState,
    FakeProfileLease,
    FakeProfileStore,
)

__all__ = ["FakeAuditSink", "FakeBrowserHost", "FakeHandoff", "FakeKeyProvider", "FakeLeaseState",
           "FakeProfileLease", "FakeProfileStore", "FakePipe"]
