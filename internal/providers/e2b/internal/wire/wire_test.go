package wire

import (
	"testing"

	"stasis/internal/golden"
)

// TestTypesFollowTheSpecification holds every wire type's json tags and
// JSON types to the digest of E2B's schemas in testdata/golden, so that a
// misspelt tag fails here even on a field no other test reads.
func TestTypesFollowTheSpecification(t *testing.T) {
	g := golden.MustLoad(t, "../../testdata/golden")
	for _, c := range []struct {
		v      any
		schema string
	}{
		{Error{}, "Error"},
		{NewSandbox{}, "NewSandbox"},
		{Sandbox{}, "Sandbox"},
		{SandboxDetail{}, "SandboxDetail"},
		{Timeout{}, "SandboxTimeoutRequest"},
		{Timeout{}, "ConnectSandbox"},
		{PauseRequest{}, "SandboxPauseRequest"},
		{SnapshotRequest{}, "SandboxSnapshotRequest"},
		{SnapshotInfo{}, "SnapshotInfo"},
		{[]SnapshotInfo{}, "SnapshotInfos"},
		{StartRequest{}, "StartRequest"},
		{StartResponse{}, "StartResponse"},
		{SendInputRequest{}, "SendInputRequest"},
		{CloseStdinRequest{}, "CloseStdinRequest"},
		{SendSignalRequest{}, "SendSignalRequest"},
		{ConnectError{}, "ConnectError"},
		{EndStream{}, "EndStreamResponse"},
	} {
		if err := g.Fields(c.v, c.schema); err != nil {
			t.Errorf("%T against %s:\n%v", c.v, c.schema, err)
		}
	}
	// A listed sandbox is decoded as a SandboxDetail: every member of
	// ListedSandbox must be one SandboxDetail reads.
	if err := g.Validate("SandboxDetail", g.Bytes(t, "sandboxes.get.response.json")); err != nil {
		t.Error(err)
	}
	for name := range g.Schemas["ListedSandbox"].Properties {
		if _, ok := g.Schemas["SandboxDetail"].Properties[name]; !ok {
			t.Errorf("ListedSandbox's %q is not a member of SandboxDetail, whose type decodes both", name)
		}
	}
	for _, s := range []string{SignalKill, SignalTerm} {
		if err := g.Validate("SendSignalRequest", []byte(`{"signal":"`+s+`"}`)); err != nil {
			t.Error(err)
		}
	}
	for _, s := range []string{StateRunning, StatePaused} {
		if err := g.Validate("SandboxState", []byte(`"`+s+`"`)); err != nil {
			t.Error(err)
		}
	}
}

// TestGoldenFilesFollowTheirSchemas checks the golden files themselves
// against the digest (a typo in a golden body would hold both sides to
// it).
func TestGoldenFilesFollowTheirSchemas(t *testing.T) {
	g := golden.MustLoad(t, "../../testdata/golden")
	for name, e := range g.Files {
		if err := g.Validate(e.Schema, g.Bytes(t, name)); err != nil {
			t.Errorf("golden %s against %s:\n%v", name, e.Schema, err)
		}
	}
}
