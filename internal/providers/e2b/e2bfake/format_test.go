package e2bfake

import (
	"testing"

	"stasis/internal/golden"
)

// TestFormatFollowsTheSpecification holds the fake's own wire types to the
// digest of E2B's schemas, as the provider's are held in internal/wire.
func TestFormatFollowsTheSpecification(t *testing.T) {
	g := golden.MustLoad(t, "../testdata/golden")
	for _, c := range []struct {
		v      any
		schema string
	}{
		{apiError{}, "Error"},
		{apiError{}, "EnvdError"},
		{newSandboxBody{}, "NewSandbox"},
		{timeoutBody{}, "SandboxTimeoutRequest"},
		{timeoutBody{}, "ConnectSandbox"},
		{pauseBody{}, "SandboxPauseRequest"},
		{snapshotBody{}, "SandboxSnapshotRequest"},
		{sandboxJSON{}, "Sandbox"},
		{[]listedJSON{}, "ListedSandboxes"},
		{detailJSON{}, "SandboxDetail"},
		{[]snapshotJSON{}, "SnapshotInfos"},
		{[]entryJSON{}, "EntryInfos"},
		{startRequestJSON{}, "StartRequest"},
		{[]startResponseJSON{}, "StartResponses"},
		{sendInputJSON{}, "SendInputRequest"},
		{closeStdinJSON{}, "CloseStdinRequest"},
		{sendSignalJSON{}, "SendSignalRequest"},
		{connectErrorJSON{}, "ConnectError"},
		{endStreamJSON{}, "EndStreamResponse"},
	} {
		if err := g.Fields(c.v, c.schema); err != nil {
			t.Errorf("%T against %s:\n%v", c.v, c.schema, err)
		}
	}
}
