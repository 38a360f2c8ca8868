package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/pgtest"
	"stasis/internal/providers/e2b"
	"stasis/internal/providers/e2b/e2bfake"
	"stasis/internal/providers/local"
	"stasis/internal/providers/microvm"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// testLease is the nodes' lease: long enough that a node renews it on a
// loaded machine (a renewal is due every third of it), short enough that
// the tests in which a node dies do not wait long for it to run out.
const testLease = 5 * time.Second

// node opens a world that is node name of the cluster on dsn.
func node(t *testing.T, dsn, name string, opts ...func(*system.Config)) *stasistest.World {
	t.Helper()
	return stasistest.NewWorld(t, append([]func(*system.Config){func(c *system.Config) {
		c.Store, c.Node, c.NodeLease, c.LivenessInterval = dsn, name, testLease, -1
	}}, opts...)...)
}

// finish waits for episode id on w, checks its reward and ledger, and
// retires it.
func finish(ctx context.Context, w *stasistest.World, id string) error {
	if _, err := w.Coordinator.Wait(ctx, id); err != nil {
		return err
	}
	v, _, err := w.Coordinator.Verify(ctx, id)
	if err != nil || v.Reward != 1 {
		return fmt.Errorf("%s: reward %d %v\n%s", id, v.Reward, err, v.Output)
	}
	if rep, err := ledger.VerifyIn(w.Gateway.Ledgers(), id); err != nil || !rep.OK || rep.Broken {
		return fmt.Errorf("%s: ledger %+v %v", id, rep, err)
	}
	return w.Coordinator.Retire(ctx, id)
}

// Three nodes on one PostgreSQL store, an episode on each, held mid-way:
// a checkpoint begun on one node takes every node's episode, each node
// its own, and commits once with all three records; then the episodes
// finish.
func TestCheckpointOverThreeNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	ws, holds := startNodes(t, ctx, dsn, nil, "a", "b", "c")
	res, err := ws[1].Member.Checkpoint(ctx, "ck-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if res.State != store.StateCommitted || len(res.Shares) != 3 || len(res.Episodes) != 1 || res.Episodes[0].Episode != "ep-b" {
		t.Fatalf("checkpoint: %+v", res)
	}
	for _, sh := range res.Shares {
		if sh.State != store.SharePrepared || sh.Records != 1 {
			t.Fatalf("share: %+v", sh)
		}
	}
	ck, recs, err := ws[0].Store.Get(ctx, "ck-1")
	if err != nil || ck.State != store.StateCommitted || len(recs) != 3 {
		t.Fatalf("the checkpoint as node a reads it: %+v, %d records, %v", ck, len(recs), err)
	}
	for i, r := range recs {
		if want := "ep-" + string(rune('a'+i)); r.Episode != want || r.SnapshotID == "" || r.LedgerTip == "" {
			t.Fatalf("record %d: %+v", i, r)
		}
	}
	finishAll(t, ctx, ws, holds)
}

// startNodes opens a node world for each name (opts[name] adjusting its
// configuration), and starts episode ep-NAME on it, held at its second
// model call.
func startNodes(t *testing.T, ctx context.Context, dsn string, opts map[string]func(*system.Config), names ...string) ([]*stasistest.World, []*relay.Hold) {
	t.Helper()
	var (
		ws    []*stasistest.World
		holds []*relay.Hold
	)
	for _, name := range names {
		var o []func(*system.Config)
		if opts[name] != nil {
			o = append(o, opts[name])
		}
		w := node(t, dsn, name, o...)
		ws = append(ws, w)
		ep := "ep-" + name
		h := w.Hold(ep, 2)
		holds = append(holds, h)
		if _, err := w.Coordinator.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
		if err := h.Wait(ctx, 1); err != nil {
			t.Fatal(err)
		}
	}
	return ws, holds
}

// finishAll releases the holds and finishes each world's episode.
func finishAll(t *testing.T, ctx context.Context, ws []*stasistest.World, holds []*relay.Hold) {
	t.Helper()
	for _, h := range holds {
		h.Release()
	}
	var wg sync.WaitGroup
	for _, w := range ws {
		if w.System == nil {
			continue
		}
		wg.Go(func() {
			for _, id := range w.Coordinator.LiveIDs() {
				if err := finish(ctx, w, id); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
}

// stallingProvider blocks every snapshot until release is closed, telling
// entered when one starts.
type stallingProvider struct {
	sandbox.Provider
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (p *stallingProvider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	p.once.Do(func() { close(p.entered) })
	<-p.release
	return p.Provider.Snapshot(ctx, id, name)
}

// A node dies in the middle of its share (its snapshot hangs, and its
// heartbeat stops): once its lease runs out the checkpoint fails, naming
// it; nothing of it is committed, the previous committed checkpoint stays
// the latest, the other nodes' snapshots for it are deleted, and their
// episodes go on to finish. The dead node, if it wakes, can finish
// nothing.
func TestNodeDiesMidPrepare(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	stall := &stallingProvider{entered: make(chan struct{}), release: make(chan struct{})}
	ws, holds := startNodes(t, ctx, dsn, nil, "a", "b")
	if _, err := ws[0].Member.Checkpoint(ctx, "ck-0", ""); err != nil {
		t.Fatal(err)
	}
	more, moreHolds := startNodes(t, ctx, dsn, map[string]func(*system.Config){"c": func(c *system.Config) {
		c.WrapProvider = func(p sandbox.Provider) sandbox.Provider { stall.Provider = p; return stall }
	}}, "c")
	ws, holds = append(ws, more...), append(holds, moreHolds...)
	c := ws[2]
	type outcome struct {
		res cluster.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := ws[0].Member.Checkpoint(ctx, "ck-1", "")
		done <- outcome{res, err}
	}()
	select {
	case <-stall.entered:
	case <-ctx.Done():
		t.Fatal("node c's snapshot never started")
	}
	c.Member.Halt() // node c dies: its lease runs out within testLease
	var o outcome
	select {
	case o = <-done:
	case <-ctx.Done():
		t.Fatal("the checkpoint never ended")
	}
	if o.err == nil || o.res.State != store.StateFailed || !strings.Contains(o.err.Error(), "lease of node c ran out") {
		t.Fatalf("checkpoint with a dead node: %+v %v", o.res, o.err)
	}
	ck, recs, err := ws[0].Store.Get(ctx, "ck-1")
	if err != nil || ck.State != store.StateFailed {
		t.Fatalf("ck-1: %+v %v", ck, err)
	}
	if l, err := ws[1].Store.Latest(ctx); err != nil || l.ID != "ck-0" {
		t.Fatalf("latest: %+v %v", l, err)
	}
	// The live nodes' snapshots for it are deleted.
	for _, r := range recs {
		w := ws[int(r.Episode[len(r.Episode)-1]-'a')]
		testwait.Until(t, "snapshot "+r.SnapshotID+" of the failed checkpoint to be deleted", time.Minute, func() bool {
			_, err := w.Provider.GetSnapshot(ctx, r.SnapshotID)
			return errors.Is(err, errdefs.ErrNotFound)
		})
	}
	// Node c wakes: its share is refused; its episode's sandbox goes.
	close(stall.release)
	row, err := ws[0].Store.GetEpisode(ctx, "ep-c")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "node c's share to end", time.Minute, func() bool {
		shares, _ := ws[0].Member.Store().Shares(ctx, "ck-1")
		return len(shares) == 3 && shares[2].State == store.ShareFailed
	})
	if err := c.Provider.Delete(ctx, row.Sandbox); err != nil {
		t.Fatal(err)
	}
	holds[2].Release()
	finishAll(t, ctx, ws[:2], holds[:2])
	c.Crash()
}

// crashAll deletes each world's episodes' sandboxes and takes its host
// side down (the node leaves), then opens it again (a new epoch), unless
// keep says not to.
func crashAll(t *testing.T, ctx context.Context, ws []*stasistest.World, reopen func(name string) bool) {
	t.Helper()
	for _, w := range ws {
		for _, id := range w.Coordinator.LiveIDs() {
			row, err := w.Store.GetEpisode(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Provider.Delete(ctx, row.Sandbox); err != nil {
				t.Fatal(err)
			}
		}
		name := w.Member.Node().Name
		w.Crash()
		if reopen(name) {
			w.Reopen()
		}
	}
}

// A checkpoint over three nodes, then everything crashes: a restore asked
// of one node brings every episode back, each on the node that drove it,
// all forks ready before any continues; the episodes finish. Then all
// crash again and node c stays down: its episode must go to a survivor,
// which cannot fork c's snapshot (the local provider keeps snapshots on
// its own disk), so the restore is aborted everywhere: no fork is left on
// any node and nothing changed.
func TestRestoreOverNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	ws, holds := startNodes(t, ctx, dsn, nil, "a", "b", "c")
	if _, err := ws[0].Member.Checkpoint(ctx, "ck-1", ""); err != nil {
		t.Fatal(err)
	}
	crashAll(t, ctx, ws, func(string) bool { return true })
	for _, h := range holds {
		h.Release()
	}
	// The next attempts stop at their second call, so that the second
	// checkpoint finds every episode running (not ended: an ended one
	// needs no fork).
	var again []*relay.Hold
	for i, w := range ws {
		again = append(again, w.HoldAttempt(fmt.Sprintf("ep-%c", 'a'+i), 1, 1_000_002))
	}
	res, err := ws[1].Member.Restore(ctx, "ck-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Restore.State != store.RestoreGo || len(res.Shares) != 3 || len(res.Episodes) != 1 || res.Episodes[0].Episode != "ep-b" {
		t.Fatalf("restore: %+v", res)
	}
	for i, sh := range res.Shares {
		if want := fmt.Sprintf("ep-%c", 'a'+i); sh.State != store.RestoreShareDone || len(sh.Episodes) != 1 || sh.Episodes[0] != want {
			t.Fatalf("share %d: %+v", i, sh)
		}
	}
	// Every episode's next attempt runs; take a checkpoint of them, then
	// crash again with node c gone for good.
	for _, h := range again {
		if err := h.Wait(ctx, 1); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ws[2].Member.Checkpoint(ctx, "ck-2", ""); err != nil {
		t.Fatal(err)
	}
	crashAll(t, ctx, ws, func(name string) bool { return name != "c" })
	_, err = ws[0].Member.Restore(ctx, "ck-2", nil)
	if err == nil || !strings.Contains(err.Error(), "aborted") {
		t.Fatalf("restore with c's snapshot out of reach: %v", err)
	}
	for _, w := range ws[:2] {
		if left, err := w.Provider.List(ctx, nil); err != nil || len(left) != 0 {
			t.Fatalf("sandboxes left on %s after the aborted restore: %+v %v", w.Member.Node().Name, left, err)
		}
		if ids := w.Coordinator.LiveIDs(); len(ids) != 0 {
			t.Fatalf("live on %s after the aborted restore: %v", w.Member.Node().Name, ids)
		}
	}
	// The rows are as the crash left them: lost where a node noticed,
	// running on node c, which is down.
	for id, want := range map[string]store.EpisodeState{"ep-a": store.EpisodeLost, "ep-b": store.EpisodeLost, "ep-c": store.EpisodeRunning} {
		if row, err := ws[0].Store.GetEpisode(ctx, id); err != nil || row.State != want || row.Attempt != 1 {
			t.Fatalf("%s after the aborted restore: %+v %v", id, row, err)
		}
	}
}

// With the snapshots in S3 (a real S3 server), a node killed after the
// commit loses nothing: its episode is restored onto a survivor, which
// forks its snapshot from S3, and every episode finishes.
func TestRestoreOntoSurvivorsFromS3(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	s3 := s3test.Start(t)
	s3.Setenv(t)
	blobs := "s3://" + s3.Bucket(t) + "/stasis"
	withBlobs := func(c *system.Config) { c.Blobs = blobs }
	ws, holds := startNodes(t, ctx, dsn, map[string]func(*system.Config){"a": withBlobs, "b": withBlobs, "c": withBlobs}, "a", "b", "c")
	if _, err := ws[1].Member.Checkpoint(ctx, "ck-1", ""); err != nil {
		t.Fatal(err)
	}
	crashAll(t, ctx, ws, func(name string) bool { return name != "c" })
	for _, h := range holds {
		h.Release()
	}
	res, err := ws[0].Member.Restore(ctx, "ck-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	placed := map[string]string{}
	for _, sh := range res.Shares {
		for _, ep := range sh.Episodes {
			placed[ep] = sh.Node
		}
	}
	if placed["ep-a"] != "a" || placed["ep-b"] != "b" || (placed["ep-c"] != "a" && placed["ep-c"] != "b") {
		t.Fatalf("placement: %v", placed)
	}
	finishAll(t, ctx, ws[:2], nil)
	for _, id := range []string{"ep-a", "ep-b", "ep-c"} {
		if row, err := ws[0].Store.GetEpisode(ctx, id); err != nil || row.State != store.EpisodeRetired {
			t.Fatalf("%s at the end: %+v %v", id, row, err)
		}
	}
}

// A node dies after a restore over the cluster went and before it
// decided its own part (its server is killed there, its lease runs out):
// the other nodes' episodes continue, the restore says which node has
// not, and when the dead node starts again its recovery asks the cluster
// whether the restore went and rolls its part forward, not back: its
// episode continues in its fork and finishes, and its share is done.
func TestNodeDiesAfterTheRestoreWent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	var (
		b     *stasistest.World
		armed atomic.Bool
	)
	kill := func(c *system.Config) {
		c.CoordinatorOptions = func(o *coordinator.Options) {
			coordinator.SetStepHook(o, func(op, step, _ string) error {
				if op != "restore" || step != "decide" || !armed.CompareAndSwap(true, false) {
					return nil
				}
				// Node b dies here: nothing more of it runs, its lease
				// runs out.
				b.Member.Halt()
				testwait.Until(t, "node b's lease to run out", time.Minute, func() bool {
					live, err := b.Member.NodeLive(ctx, "b")
					return err == nil && !live
				})
				return errors.New("node b killed after the restore went")
			})
		}
	}
	ws, holds := startNodes(t, ctx, dsn, map[string]func(*system.Config){"b": kill}, "a", "b")
	b = ws[1]
	if _, err := ws[0].Member.Checkpoint(ctx, "ck-1", ""); err != nil {
		t.Fatal(err)
	}
	crashAll(t, ctx, ws, func(string) bool { return true })
	for _, h := range holds {
		h.Release()
	}
	armed.Store(true)
	res, err := ws[0].Member.Restore(ctx, "ck-1", nil)
	if err == nil || !strings.Contains(err.Error(), "node b stopped after the restore went") {
		t.Fatalf("restore with node b killed after it went: %+v %v", res, err)
	}
	if res.Restore.State != store.RestoreGo {
		t.Fatalf("restore: %+v", res.Restore)
	}
	// Node b starts again: its part is rolled forward.
	b.Crash()
	b.Reopen()
	if ids := b.Coordinator.LiveIDs(); len(ids) != 1 || ids[0] != "ep-b" {
		t.Fatalf("live on node b after it started again: %v", ids)
	}
	_, shares, err := ws[0].Member.Store().GetRestore(ctx, res.Restore.ID)
	if err != nil || len(shares) != 2 || shares[1].Node != "b" || shares[1].State != store.RestoreShareDone || shares[1].Error != "" {
		t.Fatalf("node b's share after it started again: %+v %v", shares, err)
	}
	finishAll(t, ctx, ws, nil)
	for _, id := range []string{"ep-a", "ep-b"} {
		if row, err := ws[0].Store.GetEpisode(ctx, id); err != nil || row.State != store.EpisodeRetired || row.Attempt != 1 {
			t.Fatalf("%s at the end: %+v %v", id, row, err)
		}
	}
}

// A microVM episode checkpointed on one node resumes in place on another.
// Two nodes keep their microVM snapshots in one S3 bucket; the checkpoint
// saves each node's guest, processes and all, into it. Node a then dies
// with its sandboxes and stays down, and node b, restoring the
// checkpoint, forks a's snapshot from S3 as well as its own: in each
// fork the supervisor reports the identity it had at the pause, so both
// episodes resume in place (not relaunched), and finish with reward 1 and
// a verified ledger.
func TestMicroVMResumesInPlaceOnAnotherNode(t *testing.T) {
	if os.Getenv(microvm.KernelEnv) == "" {
		t.Fatalf("%s is not set: run the tests with make (make deps-microvm unpacks the kernel)", microvm.KernelEnv)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	s3 := s3test.Start(t)
	s3.Setenv(t)
	blobs := "s3://" + s3.Bucket(t) + "/stasis"
	guest := stasistest.StaticBinary(t)
	vm := func(c *system.Config) { c.Provider, c.GuestBinary, c.Blobs = microvm.Name, guest, blobs }
	ws, holds := startNodes(t, ctx, dsn, map[string]func(*system.Config){"a": vm, "b": vm}, "a", "b")
	ck, err := ws[0].Member.Checkpoint(ctx, "ck-1", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ck.Episodes {
		t.Logf("checkpoint: %s snapshot %s", e.Episode, e.Snapshot)
	}
	crashAll(t, ctx, ws, func(name string) bool { return name != "a" })
	for _, h := range holds {
		h.Release()
	}
	res, err := ws[1].Member.Restore(ctx, "ck-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	resumed := map[string]string{}
	for _, e := range res.Episodes {
		resumed[e.Episode] = e.Resume + " " + e.ResumeWhy
	}
	for _, id := range []string{"ep-a", "ep-b"} {
		if resumed[id] != "in_place " {
			t.Fatalf("%s on node b: resumed %q, want in_place (all: %v)", id, resumed[id], resumed)
		}
	}
	finishAll(t, ctx, ws[1:], nil)
	for _, id := range []string{"ep-a", "ep-b"} {
		if row, err := ws[1].Store.GetEpisode(ctx, id); err != nil || row.State != store.EpisodeRetired {
			t.Fatalf("%s at the end: %+v %v", id, row, err)
		}
	}
}

// A hosted provider's sandboxes are reachable from every node: node a
// starts its episode on the (fake) E2B service and is killed after a
// checkpoint; the restore, asked of node b, places the episode on b, which
// forks a's snapshot through the service's API and relaunches the harness
// there. The service's network reaches whichever node's gateway is up, as
// a load balancer in front of the nodes does; b's gateway knows the
// episode from the shared store. The episode finishes with reward 1 and a
// ledger that verifies, and the service is left with no sandbox.
func TestHostedRestoreOntoAnotherNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	gwDir, err := os.MkdirTemp("", "stasis-gw-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(gwDir) })
	sockA, sockB := filepath.Join(gwDir, "a.sock"), filepath.Join(gwDir, "b.sock")
	network := stasistest.NewNetwork(sockA, sockB)
	t.Cleanup(network.Close)
	backend, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GatewayDir: gwDir, Gateway: network})
	if err != nil {
		t.Fatal(err)
	}
	fake := e2bfake.New(backend, e2bfake.Options{APIKey: "test-key"})
	srv := httptest.NewServer(fake)
	t.Cleanup(func() { fake.Close(); srv.Close() })
	for k, v := range map[string]string{e2b.EnvAPIKey: "test-key", e2b.EnvDomain: "", e2b.EnvAPIURL: srv.URL, e2b.EnvSandboxURL: srv.URL, e2b.EnvFileOnlySnapshots: "1"} {
		t.Setenv(k, v)
	}
	hosted := func(sock string) func(*system.Config) {
		return func(c *system.Config) {
			c.Provider, c.GatewayListen = e2b.Name, "unix:"+sock
			c.GatewayURL = "unix://" + local.GatewayDirInSandbox + "/" + local.GatewaySocketName
		}
	}
	a := node(t, dsn, "a", hosted(sockA))
	b := node(t, dsn, "b", hosted(sockB))
	hold := a.Hold("ep-a", 2)
	if _, err := a.Coordinator.Start(ctx, "ep-a", "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	if err := hold.Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	ck, err := b.Member.Checkpoint(ctx, "ck-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if ck.State != store.StateCommitted || len(ck.Shares) != 2 || ck.Shares[0].Node != "a" || ck.Shares[0].Records != 1 {
		t.Fatalf("checkpoint: %+v", ck)
	}
	// Node a dies, and its sandbox with it.
	crashAll(t, ctx, []*stasistest.World{a}, func(string) bool { return false })
	hold.Release()
	res, err := b.Member.Restore(ctx, "ck-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 1 || res.Episodes[0].Episode != "ep-a" || res.Episodes[0].Resume != "relaunch" {
		t.Fatalf("restore on node b: %+v", res)
	}
	if ids := b.Coordinator.LiveIDs(); len(ids) != 1 || ids[0] != "ep-a" {
		t.Fatalf("live on node b: %v", ids)
	}
	finishAll(t, ctx, []*stasistest.World{b}, nil)
	if row, err := b.Store.GetEpisode(ctx, "ep-a"); err != nil || row.State != store.EpisodeRetired || row.Attempt != 1 {
		t.Fatalf("ep-a at the end: %+v %v", row, err)
	}
	if left := fake.Sandboxes(); len(left) != 0 {
		t.Fatalf("sandboxes left on the service: %v", left)
	}
}

// A restore over the cluster with nothing to bring back answers at once:
// a checkpoint taken with no episode, and one whose every episode was
// retired since (left out, and said so). No node gets a share of it, so
// none would ever make it go.
func TestRestoreOfNothing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	a := node(t, dsn, "a")
	if _, err := a.Member.Checkpoint(ctx, "ck-empty", ""); err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	res, err := a.Member.Restore(rctx, "ck-empty", nil)
	if err != nil || len(res.Episodes) != 0 || res.Checkpoint != "ck-empty" {
		t.Fatalf("the restore of a checkpoint with no episode: %+v %v", res, err)
	}
	h := a.Hold("ep-a", 2)
	if _, err := a.Coordinator.Start(ctx, "ep-a", "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Member.Checkpoint(ctx, "ck-1", ""); err != nil {
		t.Fatal(err)
	}
	if err := a.Coordinator.Retire(ctx, "ep-a"); err != nil {
		t.Fatal(err)
	}
	res, err = a.Member.Restore(rctx, "ck-1", nil)
	if err != nil || len(res.Episodes) != 1 || !res.Episodes[0].Excluded || res.Episodes[0].Episode != "ep-a" {
		t.Fatalf("the restore of a checkpoint whose episode was retired: %+v %v", res, err)
	}
}
