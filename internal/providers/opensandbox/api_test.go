package opensandbox

import (
	"testing"

	"stasis/internal/golden"
)

// TestTypesFollowTheSpecification holds the client's wire types' json tags
// and JSON types to the digest of OpenSandbox's schemas in
// testdata/golden, so that a misspelt tag fails here even on a field no
// other test reads.
func TestTypesFollowTheSpecification(t *testing.T) {
	g := golden.MustLoad(t, "testdata/golden")
	for _, c := range []struct {
		v      any
		schema string
		extra  []string
	}{
		{createSandboxRequest{}, "CreateSandboxRequest", nil},
		{apiSandbox{}, "Sandbox", nil},
		{listSandboxesResponse{}, "ListSandboxesResponse", nil},
		{renewExpirationRequest{}, "RenewSandboxExpirationRequest", nil},
		{renewExpirationRequest{}, "RenewSandboxExpirationResponse", nil},
		{createSnapshotRequest{}, "CreateSnapshotRequest", nil},
		{apiSnapshot{}, "Snapshot", nil},
		{apiEndpoint{}, "Endpoint", nil},
		{errorResponse{}, "ErrorResponse", nil},
		{errorResponse{}, "ExecdErrorResponse", nil},
		{runCommandRequest{}, "RunCommandRequest", nil},
		// ename and evalue at the top level: what older execds sent
		// (api.go), read besides the specification's error object.
		{streamEvent{}, "ServerStreamEvent", []string{"ename", "evalue"}},
		{fileMetadata{}, "FileMetadata", nil},
	} {
		if err := g.Fields(c.v, c.schema, c.extra...); err != nil {
			t.Errorf("%T against %s:\n%v", c.v, c.schema, err)
		}
	}
}

// TestGoldenFilesFollowTheirSchemas checks the golden files themselves
// against the digest.
func TestGoldenFilesFollowTheirSchemas(t *testing.T) {
	g := golden.MustLoad(t, "testdata/golden")
	for name, e := range g.Files {
		if err := g.Validate(e.Schema, g.Bytes(t, name)); err != nil {
			t.Errorf("golden %s against %s:\n%v", name, e.Schema, err)
		}
	}
}
