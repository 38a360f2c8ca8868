package osfake

import (
	"testing"

	"stasis/internal/golden"
)

// TestRequestTypesFollowTheSpecification holds the fake's request types to
// the digest of OpenSandbox's schemas (its answers are held to the golden
// answers' shape in golden_test.go).
func TestRequestTypesFollowTheSpecification(t *testing.T) {
	g := golden.MustLoad(t, "../testdata/golden")
	for _, c := range []struct {
		v      any
		schema string
	}{
		{createRequest{}, "CreateSandboxRequest"},
		{renewRequest{}, "RenewSandboxExpirationRequest"},
		{snapshotRequest{}, "CreateSnapshotRequest"},
		{map[string]*string{}, "PatchSandboxMetadataRequest"},
		{commandRequest{}, "RunCommandRequest"},
		{uploadMetadata{}, "FileMetadata"},
	} {
		if err := g.Fields(c.v, c.schema); err != nil {
			t.Errorf("%T against %s:\n%v", c.v, c.schema, err)
		}
	}
}
