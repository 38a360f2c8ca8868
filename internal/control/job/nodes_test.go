package job_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/job"
	"stasis/internal/control/system"
	"stasis/internal/pgtest"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
)

// The main job over three nodes on one PostgreSQL and one S3 server (each
// node a real stasis serve process with its own state directory): the
// episodes start on the nodes in turn, the checkpoint spans all three, the
// crash kills every node and sandbox, only two nodes come back, and the
// restore places the third node's episodes on them from its snapshots in
// S3. Every episode is resolved and every ledger verifies.
func TestRunOnThreeNodes(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	dsn := pgtest.DSN(t)
	s3 := s3test.Start(t)
	s3.Setenv(t)
	state := filepath.Join(tmp, "nodes-state") // kept by the run: the test's directory goes
	var socks []string
	for i := 1; i <= 3; i++ {
		sock, err := system.GatewaySocket(filepath.Join(state, fmt.Sprintf("node-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		socks = append(socks, sock)
	}
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 6, Harness: "mini", CheckpointAt: 0.4, Crash: true, State: state,
		Nodes: 3, Store: dsn, Blobs: "s3://" + s3.Bucket(t) + "/run",
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 6 || rep.Resolved != 6 || rep.Restore == nil || rep.Checkpoint.Episodes != 6 || rep.Nodes != 3 {
		t.Fatalf("report: %+v", rep)
	}
	for _, e := range rep.Episodes {
		if !e.LedgerVerified || e.Reward != 1 {
			t.Errorf("episode %+v", e)
		}
		if e.Node == "node-3" {
			t.Errorf("episode %s ended on node-3, which never came back", e.ID)
		}
	}
	left, _ := filepath.Glob(filepath.Join(tmp, "stasis-run-*"))
	if len(left) != 0 {
		t.Fatalf("state left behind: %v", left)
	}
	for _, sock := range socks {
		if _, err := os.Stat(filepath.Dir(sock)); err == nil {
			t.Errorf("a node's gateway socket directory is left: %s", filepath.Dir(sock))
		}
	}
	if _, err := job.Run(ctx, job.Options{N: 1, Nodes: 2}); err == nil {
		t.Fatal("a run over nodes without a store ran")
	}
}

// A run over nodes needs a provider whose snapshots are in the shared
// bucket; any other is refused before anything starts, naming those that
// are.
func TestRunOnNodesNeedsSharedSnapshots(t *testing.T) {
	_, err := job.Run(context.Background(), job.Options{N: 1, Nodes: 2, Store: "postgres://stasis@db/stasis", Blobs: "s3://bucket/run", Provider: "e2b", Harness: "mini"})
	if err == nil || !strings.Contains(err.Error(), "use --provider local or microvm") {
		t.Fatalf("a run over nodes on e2b: %v", err)
	}
}
