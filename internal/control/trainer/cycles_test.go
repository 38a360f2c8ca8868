package trainer_test

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/minio/minio-go/v7"
	"github.com/prometheus/common/expfmt"
	promodel "github.com/prometheus/common/model"

	"stasis/client"
	"stasis/internal/control/cli"
	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/model"
	"stasis/internal/providers/microvm"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
)

var (
	cyclesFlag      = flag.Int("cycles", 0, "TestSoakCycles: checkpoint/restore cycles to run (0: the test is skipped)")
	cycleEpsFlag    = flag.Int("cycle-episodes", 64, "TestSoakCycles: the episodes live through every cycle")
	cycleNodesFlag  = flag.Int("cycle-nodes", 1, "TestSoakCycles: 1, one `stasis serve` on its embedded store (SQLite, files, snapshots in its state directory); 2 or 3, a cluster on PostgreSQL and S3")
	cycleProvFlag   = flag.String("cycle-provider", "local", "TestSoakCycles: the sandbox provider, local or microvm (QEMU; needs "+microvm.KernelEnv+")")
	cycleTimeFlag   = flag.Duration("cycle-time", 0, "TestSoakCycles: start no new cycle once this long has passed (0: no bound)")
	cycleCPUFlag    = flag.String("cycle-cpu-profile", "", "TestSoakCycles: a directory where every node's CPU profile of every tenth cycle's checkpoint is written (cycle-N-NODE.pb.gz; go tool pprof)")
	cycleReportFlag = flag.String("cycle-report", "", "TestSoakCycles: append each cycle's resource sample to this file, one JSON object a line")
)

// heldTurn is the turn every episode's call is held at between cycles:
// two answers in its ledger before each checkpoint.
const heldTurn = 2

// sample is what one node uses after a cycle, the checkpoint before the
// last deleted and its snapshots collected.
type sample struct {
	Cycle      int     `json:"cycle"`
	Node       string  `json:"node"`
	RSSKiB     int64   `json:"rss_kib"`
	FDs        int     `json:"fds"`
	Goroutines int     `json:"goroutines"`
	Live       int     `json:"live_episodes"`
	CheckS     float64 `json:"checkpoint_s"`
	RestoreS   float64 `json:"restore_s"`
	CycleS     float64 `json:"cycle_s"`
	// CheckPhases and RestorePhases are the seconds of each phase of
	// the cycle's checkpoint and restore as the node asked answered
	// (coordinator.Result.Phases); SnapshotS is the median and the
	// slowest of its episodes' snapshots: where a slower cycle's time
	// went.
	CheckPhases   map[string]float64 `json:"checkpoint_phases,omitempty"`
	RestorePhases map[string]float64 `json:"restore_phases,omitempty"`
	SnapshotS     [2]float64         `json:"snapshot_s"`
	// DeleteS is the deletion of the cycle before's checkpoint (its
	// snapshots deleted, the blob store collected).
	DeleteS float64 `json:"delete_s"`
	// CallS is the episodes' one call each after the checkpoint, RetireS
	// their retirement, SampleS this sampling (the soak's own listing of
	// the bucket and reading of the nodes): the rest of CycleS.
	CallS   float64 `json:"call_s"`
	RetireS float64 `json:"retire_s"`
	SampleS float64 `json:"sample_s"`
	// StoreBytes: the record store (SQLite's files, or the PostgreSQL
	// database, which holds the ledgers too); LedgerBytes: the ledger
	// files (standalone); BlobBytes: the snapshots' blob store (the
	// state directory's, or the S3 bucket's objects).
	StoreBytes  int64 `json:"store_bytes"`
	LedgerBytes int64 `json:"ledger_bytes,omitempty"`
	BlobBytes   int64 `json:"blob_bytes"`
	// SnapRecordBytes: the snapshot records (standalone; a deleted
	// snapshot's stays, as a tombstone: ids are never used again).
	SnapRecordBytes int64 `json:"snapshot_record_bytes,omitempty"`
	// Stale: calls the model still held of attempts a restore replaced.
	Stale int `json:"stale_calls"`
}

// TestSoakCycles keeps -cycle-episodes episodes live through -cycles
// checkpoint/restore cycles on one server or a cluster, as a long
// training run does, and watches what the servers use: each cycle takes
// a checkpoint while every episode's call is held at the model, lets
// each episode make one more call, retires them all, restores the
// checkpoint naming them (each comes back as its next attempt, at the
// call it made after the checkpoint), deletes the previous checkpoint
// (its snapshots are collected) and samples every node: RSS, open file
// descriptors, goroutines, store and blob-store bytes. At the end every
// episode finishes, is verified (reward 1) and retired, the ledgers
// verify, and nothing is left. It fails if descriptors or goroutines grow
// from the first cycles to the last. `make soak` runs it.
func TestSoakCycles(t *testing.T) {
	if *cyclesFlag <= 0 {
		t.Skip("a soak: give -cycles N (make soak)")
	}
	n, nodes := *cycleEpsFlag, *cycleNodesFlag
	if n < 1 || nodes < 1 || nodes > maxNodes {
		t.Fatalf("-cycle-episodes %d, -cycle-nodes %d: want at least one episode and 1 to %d nodes", n, nodes, maxNodes)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Hour)
	defer cancel()
	s3 := s3test.Start(t)
	s3.Setenv(t)
	log := newSeqLog()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("what the soak did:\n%s", log)
		}
	})
	prov := *cycleProvFlag
	var guest string
	switch prov {
	case "local":
	case microvm.Name:
		if os.Getenv(microvm.KernelEnv) == "" {
			t.Fatalf("%s is not set: run the soak with make (make deps-microvm unpacks the kernel)", microvm.KernelEnv)
		}
		guest = stasistest.StaticBinary(t)
	default:
		t.Fatalf("-cycle-provider %q: local or microvm", prov)
	}
	w := newWorld(t, ctx, s3, n, nodes, log, func(w *world) {
		w.concurrency, w.quiet, w.standalone = 16, true, nodes == 1
		w.provider, w.guestBinary = prov, guest
		// Three times the nodes' default lease: a soak loads this
		// machine to the hilt (load 60 on two cores), and a node not
		// scheduled for the default's 10 s loses its lease, which aborts
		// the restore under way (as it should); nothing here crashes.
		w.nodeLease = 3 * cluster.DefaultLease
		if *cycleCPUFlag != "" {
			w.env = append(w.env, cli.CPUProfileEnv+"=1")
		}
	})
	c := &cycler{t: t, w: w, s3: s3, n: n}
	for i := 1; i <= n; i++ {
		c.ids = append(c.ids, fmt.Sprintf("ep-%d", i))
	}

	// Every episode started, round the nodes, and brought to heldTurn.
	c.each("start", func(i int, id string) error {
		api := w.up()[i%len(w.up())].api
		_, err := api.StartEpisode(ctx, client.StartRequest{ID: id, Task: taskOf(id), Harness: "mini"})
		return err
	})
	for turn := 0; turn < heldTurn; turn++ {
		c.awaitHeld(turn)
		w.gate.Release(n, func(gc model.GateCall) bool { return gc.Turn == turn })
	}
	c.awaitHeld(heldTurn)
	log.add("%d episodes on %d nodes, each held at turn %d", n, nodes, heldTurn)

	start := time.Now()
	var samples []sample
	prev := ""
	stop := stopOnSignal(t)
	for cycle := 1; cycle <= *cyclesFlag; cycle++ {
		if *cycleTimeFlag > 0 && time.Since(start) > *cycleTimeFlag {
			t.Logf("cycle time %s is up after %d cycles", *cycleTimeFlag, cycle-1)
			break
		}
		if stop() {
			t.Logf("stopped by a signal after %d cycles", cycle-1)
			break
		}
		began := time.Now()
		api := w.up()[cycle%len(w.up())].api
		ck := fmt.Sprintf("ck-%d", cycle)
		profiling := *cycleCPUFlag != "" && cycle%10 == 0
		if profiling {
			c.profile(cycle, false)
		}
		cres, err := api.Checkpoint(ctx, client.CheckpointRequest{ID: ck})
		if profiling {
			c.profile(cycle, true)
		}
		if err != nil {
			t.Fatalf("cycle %d: checkpoint: %v", cycle, err)
		}
		if got, recs, err := api.GetCheckpoint(ctx, ck); err != nil || got.State != store.StateCommitted || len(recs) != n {
			t.Fatalf("cycle %d: checkpoint %s: %v, %d records (%+v)", cycle, ck, err, len(recs), got)
		}
		checkS := time.Since(began).Seconds()
		// One more call each, past the checkpoint, then retired: the
		// restore takes each back to before that call.
		releasing := time.Now()
		w.gate.Release(n, func(gc model.GateCall) bool { return gc.Turn == heldTurn })
		c.awaitHeld(heldTurn + 1)
		retiring := time.Now()
		c.each("retire", func(_ int, id string) error { _, err := api.Retire(ctx, id); return err })
		restoring := time.Now()
		callS, retireS := retiring.Sub(releasing).Seconds(), restoring.Sub(retiring).Seconds()
		rres, err := api.RestoreWith(ctx, ck, client.RestoreRequest{Episodes: c.ids})
		if err != nil {
			t.Fatalf("cycle %d: restore of %s: %v (%+v)", cycle, ck, err, rres)
		}
		c.awaitHeld(heldTurn)
		restoreS := time.Since(restoring).Seconds()
		deleting := time.Now()
		if prev != "" {
			if _, err := api.DeleteCheckpoint(ctx, prev); err != nil {
				t.Fatalf("cycle %d: delete %s: %v", cycle, prev, err)
			}
		}
		deleteS := time.Since(deleting).Seconds()
		prev = ck
		sampling := time.Now()
		for _, s := range c.sample(cycle) {
			s.CheckS, s.RestoreS, s.CycleS = round(checkS), round(restoreS), round(time.Since(began).Seconds())
			s.CallS, s.RetireS, s.SampleS = round(callS), round(retireS), round(time.Since(sampling).Seconds())
			s.CheckPhases, s.RestorePhases = roundAll(cres.Phases), roundAll(rres.Phases)
			s.SnapshotS = snapshotSeconds(cres.Episodes)
			s.DeleteS = round(deleteS)
			samples = append(samples, s)
			c.report(s)
		}
		log.add("cycle %d: checkpoint %.1fs, restore %.1fs, %.1fs in all", cycle, checkS, restoreS, time.Since(began).Seconds())
		t.Logf("cycle %d: checkpoint %.1fs, restore %.1fs, %.1fs in all", cycle, checkS, restoreS, time.Since(began).Seconds())
	}
	cycles := 0
	if len(samples) > 0 {
		cycles = samples[len(samples)-1].Cycle
	}

	// The end: every episode finishes, is verified and retired.
	w.gate.Open()
	api := w.up()[0].api
	c.each("finish", func(_ int, id string) error {
		deadline := time.Now().Add(5 * time.Minute)
		for {
			v, err := api.Episode(ctx, id)
			if err == nil && v.Status != nil && v.Status.State == "exited" || v.State == store.EpisodeEnded {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s did not finish: %+v %v", id, v, err)
			}
			time.Sleep(200 * time.Millisecond) // poll interval, bounded by the deadline
		}
		vr, err := api.Verify(ctx, id)
		if err != nil || vr.Verdict.Reward != 1 {
			return fmt.Errorf("verify %s: %+v %v", id, vr, err)
		}
		rep, err := api.VerifyLedger(ctx, id)
		if err != nil || !rep.OK {
			return fmt.Errorf("%s's ledger: %+v %v", id, rep, err)
		}
		_, err = api.Retire(ctx, id)
		return err
	})
	if prev != "" {
		if _, err := api.DeleteCheckpoint(ctx, prev); err != nil {
			t.Fatal(err)
		}
	}
	end := c.sample(cycles + 1)
	for _, s := range end {
		c.report(s)
	}
	t.Logf("%d cycles of %d episodes on %d nodes in %s", cycles, n, nodes, time.Since(start).Round(time.Second))
	t.Logf("\n%s", growthTable(samples, end))
	w.stopNodes()
	checkGrowth(t, samples)
}

// cycler is TestSoakCycles's state.
type cycler struct {
	t   *testing.T
	w   *world
	s3  *s3test.Server
	n   int
	ids []string
}

// each runs f for every episode, eight at a time, and fails on the
// first error.
func (c *cycler) each(what string, f func(i int, id string) error) {
	c.t.Helper()
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	for i, id := range c.ids {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := f(i, id); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		c.t.Fatalf("%s: %d of %d failed, the first: %v", what, len(errs), len(c.ids), errs[0])
	}
}

// awaitHeld waits until the model holds a call of turn turn of every
// episode.
func (c *cycler) awaitHeld(turn int) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(c.w.ctx, 10*time.Minute)
	defer cancel()
	held := func(w []model.GateCall) map[string]bool {
		m := map[string]bool{}
		for _, gc := range w {
			if gc.Turn == turn {
				m[gc.Script] = true
			}
		}
		return m
	}
	if err := c.w.gate.Await(ctx, func(w []model.GateCall) bool { return len(held(w)) == c.n }); err != nil {
		got := held(c.w.gate.Waiting())
		var missing []string
		for _, id := range c.ids {
			if !got[taskOf(id)] {
				missing = append(missing, id)
			}
		}
		c.t.Fatalf("the model never held turn %d of %d episodes: %v", turn, len(missing), missing)
	}
}

// sample measures every node that is up.
func (c *cycler) sample(cycle int) []sample {
	c.t.Helper()
	ctx := c.w.ctx
	var storeBytes, blobBytes int64
	if !c.w.standalone {
		conn, err := pgx.Connect(ctx, c.w.dsn)
		if err != nil {
			c.t.Fatal(err)
		}
		err = conn.QueryRow(ctx, "SELECT pg_database_size(current_database())").Scan(&storeBytes)
		conn.Close(ctx)
		if err != nil {
			c.t.Fatal(err)
		}
		bucket, prefix, _ := strings.Cut(strings.TrimPrefix(c.w.blobs, "s3://"), "/")
		for o := range c.s3.Client(c.t).ListObjects(ctx, bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
			if o.Err != nil {
				c.t.Fatal(o.Err)
			}
			blobBytes += o.Size
		}
	}
	waiting := c.w.gate.Waiting()
	stale := 0
	for _, gc := range waiting {
		if gc.Turn != heldTurn {
			stale++
		}
	}
	var out []sample
	for _, nd := range c.w.up() {
		s := sample{Cycle: cycle, Node: nd.name, StoreBytes: storeBytes, BlobBytes: blobBytes, Stale: stale}
		pid := nd.Pid()
		s.RSSKiB = statusKiB(pid, "VmRSS")
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		s.FDs = len(fds)
		m := metricsOf(c.t, nd.url)
		s.Goroutines, s.Live = int(m["go_goroutines"]), int(m["stasis_server_live_episodes"])
		if c.w.standalone {
			s.StoreBytes = sizeOf(filepath.Join(nd.state, "store.db")) + sizeOf(filepath.Join(nd.state, "store.db-wal"))
			s.LedgerBytes = duOf(filepath.Join(nd.state, "gateway"))
			home := filepath.Join(nd.state, *cycleProvFlag)
			s.BlobBytes = duOf(filepath.Join(home, "blobs")) + duOf(filepath.Join(home, "vmblobs"))
			s.SnapRecordBytes = duOf(filepath.Join(home, "snapshots"))
		}
		out = append(out, s)
	}
	return out
}

// profile starts every node's CPU profile, or ends it and copies it to
// -cycle-cpu-profile (cli.CPUProfileEnv: alternate SIGUSR2s).
func (c *cycler) profile(cycle int, ending bool) {
	c.t.Helper()
	for _, nd := range c.w.up() {
		src := filepath.Join(nd.state, "cpu.pb.gz")
		if ending {
			_ = os.Remove(src + ".done") // the server removed it at the start too
		}
		if err := nd.Signal(syscall.SIGUSR2); err != nil {
			c.t.Fatal(err)
		}
		if !ending {
			continue
		}
		deadline := time.Now().Add(time.Minute)
		for !fileExists(src + ".done") {
			if time.Now().After(deadline) {
				c.t.Fatalf("%s wrote no CPU profile within a minute", nd.name)
			}
			time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline
		}
		b, err := os.ReadFile(src)
		if err == nil {
			err = os.WriteFile(filepath.Join(*cycleCPUFlag, fmt.Sprintf("cycle-%d-%s.pb.gz", cycle, nd.name)), b, 0o644)
		}
		if err != nil {
			c.t.Fatal(err)
		}
	}
}

// report appends s to -cycle-report.
func (c *cycler) report(s sample) {
	if *cycleReportFlag == "" {
		return
	}
	f, err := os.OpenFile(*cycleReportFlag, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.t.Fatal(err)
	}
	defer f.Close()
	b, _ := json.Marshal(s)
	if _, err := f.Write(append(b, '\n')); err != nil {
		c.t.Fatal(err)
	}
}

// statusKiB is a field of /proc/PID/status in KiB (0 if unreadable).
func statusKiB(pid int, field string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}

// metricsOf reads the unlabelled samples of a server's /metrics.
func metricsOf(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(promodel.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("%s/metrics: %v", url, err)
	}
	m := map[string]float64{}
	for name, f := range fams {
		for _, s := range f.GetMetric() {
			if len(s.GetLabel()) > 0 {
				continue
			}
			switch {
			case s.Gauge != nil:
				m[name] = s.GetGauge().GetValue()
			case s.Counter != nil:
				m[name] = s.GetCounter().GetValue()
			case s.Untyped != nil:
				m[name] = s.GetUntyped().GetValue()
			}
		}
	}
	return m
}

func sizeOf(p string) int64 {
	fi, err := os.Stat(p)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// duOf is the bytes the regular files under dir take on disk (a sparse
// disk image counts what it has written).
func duOf(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				if st, ok := fi.Sys().(*syscall.Stat_t); ok {
					n += st.Blocks * 512
				} else {
					n += fi.Size()
				}
			}
		}
		return nil
	})
	return n
}

func round(s float64) float64 { return float64(int64(s*100)) / 100 }

// roundAll rounds every value of m.
func roundAll(m map[string]float64) map[string]float64 {
	out := make(map[string]float64, len(m))
	for k, v := range m {
		out[k] = round(v)
	}
	return out
}

// snapshotSeconds is the median and the longest snapshot of eps.
func snapshotSeconds(eps []coordinator.EpisodeFigures) [2]float64 {
	var s []float64
	for _, e := range eps {
		if e.Snapshot != "" {
			s = append(s, e.SnapshotS)
		}
	}
	if len(s) == 0 {
		return [2]float64{}
	}
	slices.Sort(s)
	return [2]float64{round(s[len(s)/2]), round(s[len(s)-1])}
}

// growthTable is the first cycle's samples against the last's and the
// end's (every episode retired, every checkpoint deleted), per node.
func growthTable(samples, end []sample) string {
	if len(samples) == 0 {
		return "no cycle ran"
	}
	first, last := samples[0].Cycle, samples[len(samples)-1].Cycle
	var b strings.Builder
	fmt.Fprintf(&b, "| node | after | RSS MiB | fds | goroutines | live | store MiB | ledgers MiB | blobs MiB | snapshot records MiB | stale calls | cycle s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	row := func(label string, s sample) {
		fmt.Fprintf(&b, "| %s | %s | %.1f | %d | %d | %d | %.2f | %.2f | %.1f | %.1f | %d | %.1f |\n", s.Node, label, float64(s.RSSKiB)/1024, s.FDs, s.Goroutines, s.Live,
			float64(s.StoreBytes)/(1<<20), float64(s.LedgerBytes)/(1<<20), float64(s.BlobBytes)/(1<<20), float64(s.SnapRecordBytes)/(1<<20), s.Stale, s.CycleS)
	}
	for _, s := range samples {
		if s.Cycle == first {
			row(fmt.Sprintf("cycle %d", first), s)
		}
	}
	for _, s := range samples {
		if s.Cycle == last && last != first {
			row(fmt.Sprintf("cycle %d", last), s)
		}
	}
	for _, s := range end {
		row("the end", s)
	}
	return b.String()
}

// checkGrowth fails if a node's descriptors or goroutines after the last
// cycle exceed the most it had after any of the first three by more than
// a margin (what is in flight when it is sampled varies), or if stale
// calls pile up.
func checkGrowth(t *testing.T, samples []sample) {
	t.Helper()
	if len(samples) == 0 {
		return
	}
	last := samples[len(samples)-1].Cycle
	early := map[string]sample{}
	for _, s := range samples {
		if s.Cycle > 3 {
			continue
		}
		e := early[s.Node]
		e.FDs, e.Goroutines = max(e.FDs, s.FDs), max(e.Goroutines, s.Goroutines)
		early[s.Node] = e
	}
	for _, s := range samples {
		if s.Cycle != last || last <= 3 {
			continue
		}
		e := early[s.Node]
		if s.FDs > e.FDs+e.FDs/10+16 {
			t.Errorf("%s: %d open descriptors after cycle %d, at most %d after the first three", s.Node, s.FDs, last, e.FDs)
		}
		if s.Goroutines > e.Goroutines+e.Goroutines/10+64 {
			t.Errorf("%s: %d goroutines after cycle %d, at most %d after the first three", s.Node, s.Goroutines, last, e.Goroutines)
		}
		if s.Stale > 0 {
			t.Errorf("after cycle %d the model still holds %d calls of replaced attempts", last, s.Stale)
		}
	}
}
