package cli_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"errors"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/home"
	"stasis/internal/control/system"
	"stasis/internal/providers/local"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// ckpt runs "stasis ckpt ARGS" as a separate process with STASIS_HOME set to
// dir and returns its stdout, stderr and exit code.
func ckpt(t *testing.T, dir string, args ...string) (string, string, int) {
	t.Helper()
	return stasistest.Run(t, []string{home.Env + "=" + dir}, "", append([]string{"ckpt"}, args...)...)
}

func ckptRecord(t *testing.T, doc string) store.Record {
	t.Helper()
	r, err := store.DecodeRecord([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// seedCkpts makes a store in dir with two checkpoints: ckpt-1 committed
// (snapshots snap-1, snap-2), then ckpt-2 failed (snap-2, snap-3).
func seedCkpts(t *testing.T, dir string) {
	t.Helper()
	ctx := context.Background()
	s, err := store.OpenSQLite(filepath.Join(dir, store.FileName))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	inPlace := `{"episode":"ep-0","provider":"local","sandbox":{"id":"sb-0"},"snapshot_id":"SNAP","keeps_processes":true,
		"pause_seq":4,"pause_mode":"hold","pause_confirmed":true,"identity":{"pid":3981,"start_time":196715},
		"pause_wall":1796202672.804,"pause_uptime":1967.18,"attempt":1}`
	relaunch := `{"episode":"ep-1","provider":"local","sandbox":{"id":"sb-1"},"snapshot_id":"SNAP",
		"pause_seq":4,"pause_mode":"stop","pause_confirmed":false,"attempt":0,"future_field":{"kept":true}}`
	steps := []struct {
		id     string
		snaps  [2]string
		expect int
	}{{"ckpt-1", [2]string{"snap-1", "snap-2"}, 2}, {"ckpt-2", [2]string{"snap-2", "snap-3"}, 3}}
	for _, st := range steps {
		if err := s.Begin(ctx, st.id, json.RawMessage(`{"trainer_step":100}`)); err != nil {
			t.Fatal(err)
		}
		for i, doc := range []string{inPlace, relaunch} {
			if err := s.Put(ctx, st.id, ckptRecord(t, strings.Replace(doc, "SNAP", st.snaps[i], 1))); err != nil {
				t.Fatal(err)
			}
		}
		err := s.Commit(ctx, st.id, st.expect)
		if (err != nil) != (st.expect != 2) {
			t.Fatalf("commit %s: %v", st.id, err)
		}
	}
}

func TestCkptListShowRemove(t *testing.T) {
	dir := t.TempDir()
	seedCkpts(t, dir)

	out, errOut, code := ckpt(t, dir, "ls")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 3 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[0], "EPISODES") ||
		!strings.HasPrefix(lines[1], "ckpt-2 ") || !strings.Contains(lines[1], "failed") || !strings.Contains(lines[1], "3 were expected") ||
		!strings.HasPrefix(lines[2], "ckpt-1 ") || !strings.Contains(lines[2], "committed") {
		t.Fatalf("ls: exit %d\n%s%s", code, out, errOut)
	}
	out, _, code = ckpt(t, dir, "ls", "--json")
	var cs []store.Checkpoint
	if code != 0 || json.Unmarshal([]byte(out), &cs) != nil || len(cs) != 2 || cs[0].ID != "ckpt-2" || cs[1].State != store.StateCommitted || cs[1].Episodes != 2 {
		t.Fatalf("ls --json: exit %d\n%s", code, out)
	}
	out, _, code = ckpt(t, dir, "ls", "--state", "committed", "--json")
	if code != 0 || json.Unmarshal([]byte(out), &cs) != nil || len(cs) != 1 || cs[0].ID != "ckpt-1" {
		t.Fatalf("ls --state committed: exit %d\n%s", code, out)
	}

	out, errOut, code = ckpt(t, dir, "show", "ckpt-1")
	if code != 0 || !strings.Contains(out, "state:") || !strings.Contains(out, "committed") || !strings.Contains(out, `{"trainer_step":100}`) {
		t.Fatalf("show: exit %d\n%s%s", code, out, errOut)
	}
	rows := map[string][]string{}
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], "ep-") {
			rows[f[0]] = f
		}
	}
	if r := rows["ep-0"]; strings.Join(r, " ") != "ep-0 local snap-1 true 4/hold in-place 1" {
		t.Errorf("show: ep-0 row %q\n%s", r, out)
	}
	if r := rows["ep-1"]; strings.Join(r, " ") != "ep-1 local snap-2 false 4/stop (unconfirmed) relaunch 0" {
		t.Errorf("show: ep-1 row %q\n%s", r, out)
	}
	out, _, code = ckpt(t, dir, "show", "ckpt-1", "--json")
	var shown struct {
		Checkpoint store.Checkpoint
		Records    []map[string]any
		Restore    map[string]string
	}
	if code != 0 || json.Unmarshal([]byte(out), &shown) != nil || shown.Checkpoint.ID != "ckpt-1" || len(shown.Records) != 2 ||
		shown.Records[1]["future_field"] == nil || shown.Records[0]["identity"] == nil ||
		shown.Restore["ep-0"] != "in-place" || shown.Restore["ep-1"] != "relaunch" {
		t.Fatalf("show --json: exit %d\n%s", code, out)
	}

	for _, args := range [][]string{{"show", "nope"}, {"rm", "nope"}} {
		out, errOut, code = ckpt(t, dir, args...)
		if code != 3 || !strings.Contains(errOut, `checkpoint "nope": not found`) || !strings.Contains(errOut, "stasis ckpt ls") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q", args, code, out, errOut)
		}
		out, _, code = ckpt(t, dir, append(args, "--json")...)
		var e map[string]string
		if code != 3 || json.Unmarshal([]byte(out), &e) != nil || e["code"] != "not_found" || !strings.Contains(e["error"], "nope") {
			t.Errorf("%v --json: exit %d, %s", args, code, out)
		}
	}
	if _, errOut, code = ckpt(t, dir, "show"); code != 2 || !strings.Contains(errOut, "takes one checkpoint id") {
		t.Errorf("show without an id: exit %d, %s", code, errOut)
	}
	if _, errOut, code = ckpt(t, dir, "ls", "--state", "done"); code != 2 || !strings.Contains(errOut, "use pending, committed or failed") {
		t.Errorf("ls --state done: exit %d, %s", code, errOut)
	}

	// ckpt-1 alone referenced snap-1; snap-2 is still ckpt-2's. The local
	// provider deletes snap-1 (it never existed here: deleting it is a no-op).
	out, errOut, code = ckpt(t, dir, "rm", "ckpt-1")
	if code != 0 || !strings.Contains(out, "deleted checkpoint ckpt-1") || !strings.Contains(out, "local/snap-1") ||
		strings.Contains(out, "snap-2") || strings.Contains(out, "NOT deleted") {
		t.Fatalf("rm: exit %d\n%s%s", code, out, errOut)
	}
	if _, _, code = ckpt(t, dir, "show", "ckpt-1"); code != 3 {
		t.Fatalf("show after rm: exit %d", code)
	}
	out, _, code = ckpt(t, dir, "rm", "ckpt-2", "--json")
	var rm struct {
		Deleted          string
		Unreferenced     []store.SnapshotRef
		SnapshotsDeleted bool `json:"snapshots_deleted"`
		Note             string
	}
	if code != 0 || json.Unmarshal([]byte(out), &rm) != nil || rm.Deleted != "ckpt-2" || !rm.SnapshotsDeleted || rm.Note != "" ||
		len(rm.Unreferenced) != 2 || rm.Unreferenced[0] != (store.SnapshotRef{Provider: "local", SnapshotID: "snap-2"}) ||
		rm.Unreferenced[1].SnapshotID != "snap-3" {
		t.Fatalf("rm --json: exit %d\n%s", code, out)
	}
	out, _, code = ckpt(t, dir, "ls", "--json")
	if code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("ls --json of an empty store: exit %d %s", code, out)
	}
	if out, _, code = ckpt(t, dir, "ls"); code != 0 || !strings.Contains(out, "no checkpoints") {
		t.Fatalf("ls of an empty store: exit %d %s", code, out)
	}

	// A pending checkpoint is refused unless --force.
	s, err := store.OpenSQLite(filepath.Join(dir, store.FileName))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Begin(context.Background(), "ckpt-3", nil); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, errOut, code = ckpt(t, dir, "rm", "ckpt-3"); code != 2 || !strings.Contains(errOut, "pending") || !strings.Contains(errOut, "--force") {
		t.Fatalf("rm of a pending checkpoint: exit %d, %s", code, errOut)
	}
	if out, errOut, code = ckpt(t, dir, "rm", "ckpt-3", "--force"); code != 0 || !strings.Contains(out, "no snapshot became unreferenced") {
		t.Fatalf("rm --force: exit %d, %s%s", code, out, errOut)
	}
}

// localSandbox opens a local provider with o (this test binary as its
// stasis) and makes a sandbox in it; both are removed when the test ends.
func localSandbox(t *testing.T, o local.Options) (*local.Provider, string) {
	t.Helper()
	o.Exe, o.ExeEnv = stasistest.Exe(), stasistest.Env
	p, err := local.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	sb, err := p.Create(context.Background(), sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Delete(context.Background(), sb.ID) })
	return p, sb.ID
}

// TestCkptRmFreesRealSnapshot: removing the only checkpoint that names a
// real local snapshot deletes the snapshot through the provider, where the
// stasis serve that took it keeps it (system.ProviderHome of its state
// directory): the store found through $STASIS_HOME, or named by --store
// from anywhere. Before, rm opened the provider on $STASIS_HOME itself,
// found no such snapshot there, and said it had deleted it.
func TestCkptRmFreesRealSnapshot(t *testing.T) {
	for _, how := range []string{"home", "store"} {
		t.Run(how, func(t *testing.T) {
			dir := t.TempDir()
			ctx := context.Background()
			p, sb := localSandbox(t, local.Options{Home: system.ProviderHome(dir, local.Name)})
			if err := p.WriteFile(ctx, sb, "/work/f", []byte("data"), 0o644); err != nil {
				t.Fatal(err)
			}
			snap, err := p.Snapshot(ctx, sb, "")
			if err != nil {
				t.Fatal(err)
			}
			s, err := store.OpenSQLite(filepath.Join(dir, store.FileName))
			if err != nil {
				t.Fatal(err)
			}
			rec := ckptRecord(t, `{"episode":"ep-0","provider":"local","sandbox":{"id":"`+sb+`"},"snapshot_id":"`+snap.ID+`","pause_seq":1,"pause_mode":"stop","pause_confirmed":true,"attempt":0}`)
			if err := s.Begin(ctx, "real", nil); err != nil {
				t.Fatal(err)
			}
			if err := s.Put(ctx, "real", rec); err != nil {
				t.Fatal(err)
			}
			if err := s.Commit(ctx, "real", 1); err != nil {
				t.Fatal(err)
			}
			s.Close()
			var out, errOut string
			var code int
			if how == "home" {
				out, errOut, code = ckpt(t, dir, "rm", "real")
			} else {
				out, errOut, code = ckpt(t, t.TempDir(), "rm", "real", "--store", filepath.Join(dir, store.FileName))
			}
			if code != 0 || !strings.Contains(out, snap.ID) {
				t.Fatalf("rm: exit %d\n%s%s", code, out, errOut)
			}
			if _, err := p.GetSnapshot(ctx, snap.ID); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("the snapshot survived the removal of its only checkpoint: %v", err)
			}
		})
	}
}

// TestCkptRmFreesSharedSnapshots: with --blobs, rm deletes the local
// provider's snapshots in the S3 store the nodes share, every one of them
// (the provider opened for each is closed before the next).
func TestCkptRmFreesSharedSnapshots(t *testing.T) {
	srv := s3test.Start(t)
	srv.Setenv(t)
	url := "s3://" + srv.Bucket(t) + "/ckpt"
	ctx := context.Background()
	p, sb := localSandbox(t, local.Options{Home: t.TempDir(), Blobs: url})
	dir := t.TempDir() // the operator's, with the record store
	s, err := store.OpenSQLite(filepath.Join(dir, store.FileName))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Begin(ctx, "shared", nil); err != nil {
		t.Fatal(err)
	}
	var snaps []string
	for i := range 2 {
		snap, err := p.Snapshot(ctx, sb, "")
		if err != nil {
			t.Fatal(err)
		}
		snaps = append(snaps, snap.ID)
		rec := ckptRecord(t, fmt.Sprintf(`{"episode":"ep-%d","provider":"local","sandbox":{"id":"%s"},"snapshot_id":"%s","pause_seq":1,"pause_mode":"stop","pause_confirmed":true,"attempt":0}`, i, sb, snap.ID))
		if err := s.Put(ctx, "shared", rec); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Commit(ctx, "shared", 2); err != nil {
		t.Fatal(err)
	}
	s.Close()
	out, errOut, code := ckpt(t, dir, "rm", "shared", "--blobs", url)
	if code != 0 {
		t.Fatalf("rm: exit %d\n%s%s", code, out, errOut)
	}
	for _, id := range snaps {
		if _, err := p.GetSnapshot(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("snapshot %s survived the removal of its only checkpoint: %v", id, err)
		}
	}
}
