package bench

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"stasis/client"
	"stasis/internal/control/system"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/store"
)

// ClusterOptions configure Cluster.
type ClusterOptions struct {
	// Exe is the stasis binary the nodes run (`stasis serve --node`);
	// Env is extra environment for it (tests run their own binary).
	Exe string
	Env []string
	// Store is a postgres:// URL whose role may create databases: each
	// size runs on a database of its own, made beside Store's and
	// dropped afterwards.
	Store string
	// Sizes are the episode counts (default 1250, 2500, 5000, 10000),
	// spread evenly over Nodes nodes (default 4).
	Sizes []int
	Nodes int
	// Task is the task every episode runs (default py-ini-value-with-equals;
	// the simulated harness does not run it).
	Task string
	// Concurrency is each node's coordinator concurrency (0: serve's
	// default). StartConcurrency is how many episodes each node is asked
	// to start at once (default 4: the record store's journal takes its
	// appends one after another, and many more at once exhaust its
	// retries of serialization failures).
	Concurrency      int
	StartConcurrency int
	// NodeLease is the nodes' --node-lease (default 60 s). With serve's
	// default of 10 s, two of 4 nodes busy with a checkpoint of 1,250
	// episodes on a loaded 2-core machine failed to renew their leases in
	// time, and the checkpoint failed (see BENCHMARKS.md).
	NodeLease time.Duration
	// Dir is where the nodes' state directories are made (default: a
	// temporary directory, removed afterwards).
	Dir string
	// Timeout bounds each size's run (default 20 minutes).
	Timeout  time.Duration
	Progress io.Writer
	// Settle is how long the database's transaction counts are given to
	// show everything (default statsSettle); tests shorten it, and then
	// the counts may miss some.
	Settle time.Duration
	// HeapProfile, when set, is a directory where node 1's heap profile is
	// written once its episodes are started (heap-EPISODES.pb.gz).
	HeapProfile string
	// CPUProfile, when set, is a directory where node 1's CPU profile of
	// the checkpoint, from just before it is asked for until its answer,
	// is written (cpu-EPISODES.pb.gz).
	CPUProfile string
}

// NodeMemory is one node's memory at one size.
type NodeMemory struct {
	Node     string `json:"node"`
	Episodes int    `json:"episodes"`
	// BaseKiB is its RSS once it serves, before any episode; StartedKiB
	// once its episodes are started; PeakKiB its high-water mark (VmHWM)
	// after the checkpoint.
	BaseKiB    int64 `json:"base_kib"`
	StartedKiB int64 `json:"started_kib"`
	PeakKiB    int64 `json:"peak_kib"`
}

// ClusterRow is one size's figures.
type ClusterRow struct {
	Episodes int `json:"episodes"`
	Nodes    int `json:"nodes"`
	// StartS is the time to start every episode (all nodes at once).
	StartS float64 `json:"start_s"`
	// CheckpointS is POST /v1/checkpoints on node 1 until it answered
	// (committed, and node 1's episodes continued); CommitS is from the
	// checkpoint's row made to its commit, by the database's clock.
	CheckpointS float64 `json:"checkpoint_s"`
	CommitS     float64 `json:"commit_s"`
	// Transactions is the database's transactions (pg_stat_database
	// xact_commit + xact_rollback) from before the checkpoint began to
	// after it committed and every node continued; IdleTransactions is
	// the same count over a window as long with no checkpoint (leases,
	// liveness), measured just before.
	Transactions     int64   `json:"transactions"`
	IdleTransactions int64   `json:"idle_transactions"`
	WindowS          float64 `json:"window_s"`
	// StoreOnlyS is the store's part alone at the same size, in the same
	// run: 4 nodes' views put the records 64 at once and finish their
	// shares (the store benchmark BenchmarkCheckpointShared's work).
	StoreOnlyS float64      `json:"store_only_s"`
	Memory     []NodeMemory `json:"memory"`
	// MiBPerEpisode is the most any node's RSS grew from its base per
	// episode it drives, once started; PeakMiBPerEpisode the same of its
	// high-water mark, after the checkpoint.
	MiBPerEpisode     float64 `json:"mib_per_episode"`
	PeakMiBPerEpisode float64 `json:"peak_mib_per_episode"`
}

// statsSettle is how long PostgreSQL may keep a backend's counts before
// pg_stat_database shows them: an idle backend flushes them within 10 s
// (PGSTAT_IDLE_INTERVAL).
const statsSettle = 11 * time.Second

// Cluster measures a checkpoint over Nodes `stasis serve --node`
// processes with the simulated provider, sharing one PostgreSQL database,
// at each size: time to commit, database transactions, and each node's
// memory per episode against its own RSS before any episode.
func Cluster(ctx context.Context, o ClusterOptions) ([]ClusterRow, error) {
	if o.Store == "" {
		return nil, errors.New("bench cluster: give --store postgres://… (a role that may create databases)")
	}
	if len(o.Sizes) == 0 {
		o.Sizes = []int{1250, 2500, 5000, 10000}
	}
	if o.Nodes == 0 {
		o.Nodes = 4
	}
	if o.Task == "" {
		o.Task = "py-ini-value-with-equals"
	}
	if o.Timeout == 0 {
		o.Timeout = 20 * time.Minute
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	if o.NodeLease == 0 {
		o.NodeLease = time.Minute
	}
	if o.StartConcurrency == 0 {
		o.StartConcurrency = 4
	}
	if o.Settle == 0 {
		o.Settle = statsSettle
	}
	var rows []ClusterRow
	for _, n := range o.Sizes {
		if n < o.Nodes {
			return rows, fmt.Errorf("size %d: give at least one episode per node (%d nodes)", n, o.Nodes)
		}
		row, err := clusterOnce(ctx, o, n)
		if err != nil {
			return rows, fmt.Errorf("%d episodes: %w", n, err)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// database makes a new database beside dsn's and returns its URL and
// how to drop it.
func database(ctx context.Context, dsn, name string) (string, func() error, error) {
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		return "", nil, err
	}
	if _, err := admin.ExecContext(ctx, `CREATE DATABASE `+name); err != nil {
		admin.Close()
		return "", nil, fmt.Errorf("create database %s (the --store role must be allowed to): %w", name, err)
	}
	u, err := url.Parse(dsn)
	if err != nil {
		admin.Close()
		return "", nil, err
	}
	u.Path = "/" + name
	drop := func() error {
		defer admin.Close()
		dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, err := admin.ExecContext(dctx, `DROP DATABASE `+name+` WITH (FORCE)`)
		return err
	}
	return u.String(), drop, nil
}

// node is one `stasis serve --node` child.
type node struct {
	name  string
	state string
	cmd   *exec.Cmd
	api   *client.Client
	log   *os.File
	done  chan struct{}
}

func startNode(ctx context.Context, o ClusterOptions, name, state, dsn string) (*node, error) {
	if err := os.MkdirAll(state, 0o700); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(state, "serve.log"))
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--listen", "127.0.0.1:0", "--state", state, "--provider", "sim", "--node", name, "--node-lease", o.NodeLease.String(), "--store", dsn, "--log-format", "json", "--log-level", "warn"}
	if o.Concurrency > 0 {
		args = append(args, "--concurrency", strconv.Itoa(o.Concurrency))
	}
	cmd := exec.Command(o.Exe, args...)
	cmd.Env = append(os.Environ(), o.Env...)
	if o.HeapProfile != "" && name == "node-1" {
		cmd.Env = append(cmd.Env, "STASIS_HEAP_PROFILE_SIGNAL=1") // cli.HeapProfileEnv
	}
	if o.CPUProfile != "" && name == "node-1" {
		cmd.Env = append(cmd.Env, "STASIS_CPU_PROFILE_SIGNAL=1") // cli.CPUProfileEnv
	}
	cmd.Stderr = logf
	// The node dies with this process, whatever ends it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	n := &node{name: name, state: state, cmd: cmd, log: logf, done: make(chan struct{})}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			addr <- strings.TrimSpace(sc.Text())
		}
		close(addr)
		_, _ = io.Copy(io.Discard, out)
	}()
	go func() { _ = cmd.Wait(); close(n.done) }()
	wait := time.NewTimer(2 * time.Minute)
	defer wait.Stop()
	select {
	case a, ok := <-addr:
		if ok && a != "" {
			if n.api, err = client.New("http://" + a); err == nil {
				return n, nil
			}
		}
		n.stop()
		tail, _ := os.ReadFile(logf.Name())
		return nil, fmt.Errorf("%s did not start (%v); its log:\n%s", name, err, lastLines(string(tail), 20))
	case <-wait.C:
		n.stop()
		return nil, fmt.Errorf("%s printed no address within 2 minutes", name)
	case <-ctx.Done():
		n.stop()
		return nil, ctx.Err()
	}
}

// stop ends the node (SIGTERM, SIGKILL after 30 s): its simulated
// sandboxes end with it; the gateway socket directory it leaves for them
// is removed.
func (n *node) stop() {
	if n.cmd.Process != nil {
		_ = n.cmd.Process.Signal(syscall.SIGTERM)
		t := time.NewTimer(30 * time.Second)
		select {
		case <-n.done:
		case <-t.C:
			_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
			<-n.done
		}
		t.Stop()
	}
	n.log.Close()
	if sock, err := system.GatewaySocket(n.state); err == nil {
		_ = os.RemoveAll(filepath.Dir(sock))
	}
}

func lastLines(s string, k int) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	if len(ls) > k {
		ls = ls[len(ls)-k:]
	}
	return strings.Join(ls, "\n")
}

// procKiB reads a field (VmRSS, VmHWM) of /proc/PID/status, in KiB.
func procKiB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("/proc/%d/status has no %s", pid, field)
}

func xacts(ctx context.Context, db *sql.DB) (int64, error) {
	var n int64
	err := db.QueryRowContext(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

func clusterOnce(ctx context.Context, o ClusterOptions, episodes int) (row ClusterRow, err error) {
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	row = ClusterRow{Episodes: episodes, Nodes: o.Nodes}
	say := func(format string, args ...any) {
		fmt.Fprintf(o.Progress, "[%d] "+format+"\n", append([]any{episodes}, args...)...)
	}

	// The store's part alone first, on a database of its own.
	suffix := fmt.Sprintf("%d_%d_%d", os.Getpid(), episodes, time.Now().UnixNano()%1e6)
	if row.StoreOnlyS, err = storeOnly(ctx, o, episodes, "stasis_bench_store_"+suffix); err != nil {
		return row, fmt.Errorf("the store's part alone: %w", err)
	}
	say("store alone: %.2f s", row.StoreOnlyS)

	dsn, drop, err := database(ctx, o.Store, "stasis_bench_"+suffix)
	if err != nil {
		return row, err
	}
	dir := o.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "stasis-bench-cluster-"); err != nil {
			_ = drop()
			return row, err
		}
		defer os.RemoveAll(dir)
	}
	var nodes []*node
	defer func() {
		var wg sync.WaitGroup
		for _, n := range nodes {
			wg.Go(n.stop)
		}
		wg.Wait()
		if derr := drop(); derr != nil && err == nil {
			err = derr
		}
	}()
	for i := range o.Nodes {
		name := fmt.Sprintf("node-%d", i+1)
		n, err := startNode(ctx, o, name, filepath.Join(dir, fmt.Sprintf("%d-%s", episodes, name)), dsn)
		if err != nil {
			return row, err
		}
		nodes = append(nodes, n)
	}
	row.Memory = make([]NodeMemory, len(nodes))
	for i, n := range nodes {
		row.Memory[i].Node = n.name
		if row.Memory[i].BaseKiB, err = procKiB(n.cmd.Process.Pid, "VmRSS"); err != nil {
			return row, err
		}
	}
	say("%d nodes up; starting %d episodes", len(nodes), episodes)

	// Start the episodes: node i gets every len(nodes)-th, each node
	// StartConcurrency at once.
	t0 := time.Now()
	var started atomic.Int64
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	deadline := 6 * 24 * 3600.0 // the simulated harness must not end on its own during the run
	for i, n := range nodes {
		for w := range o.StartConcurrency {
			wg.Go(func() {
				for e := i + w*len(nodes); e < episodes; e += o.StartConcurrency * len(nodes) {
					if ctx.Err() != nil || errs[i] != nil {
						return
					}
					_, err := n.api.StartEpisode(ctx, client.StartRequest{ID: fmt.Sprintf("ep-%06d", e), Task: o.Task, Harness: "mini", DeadlineS: &deadline})
					if err != nil {
						errs[i] = fmt.Errorf("start ep-%06d on %s: %w", e, n.name, err)
						return
					}
					if k := started.Add(1); k%1000 == 0 {
						say("%d started (%.0f s)", k, time.Since(t0).Seconds())
					}
				}
			})
		}
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return row, err
	}
	row.StartS = time.Since(t0).Seconds()
	for i := range nodes {
		row.Memory[i].Episodes = len(episodeRange(i, len(nodes), episodes))
	}
	for i, n := range nodes {
		if row.Memory[i].StartedKiB, err = procKiB(n.cmd.Process.Pid, "VmRSS"); err != nil {
			return row, err
		}
	}
	say("started in %.1f s", row.StartS)
	if o.HeapProfile != "" {
		if err := profile(ctx, nodes[0], syscall.SIGUSR1, "heap.pb.gz", filepath.Join(o.HeapProfile, fmt.Sprintf("heap-%d.pb.gz", episodes))); err != nil {
			return row, err
		}
	}

	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return row, err
	}
	defer db.Close()
	// The idle baseline: the transactions of a window with no checkpoint.
	idle0, err := xacts(ctx, db)
	if err != nil {
		return row, err
	}
	select {
	case <-time.After(o.Settle): // the measurement's window, not a wait for an event
	case <-ctx.Done():
		return row, ctx.Err()
	}
	idle1, err := xacts(ctx, db)
	if err != nil {
		return row, err
	}
	row.IdleTransactions = idle1 - idle0

	x0 := idle1
	if o.CPUProfile != "" {
		if err := nodes[0].cmd.Process.Signal(syscall.SIGUSR2); err != nil {
			return row, err
		}
	}
	t1 := time.Now()
	res, err := nodes[0].api.Checkpoint(ctx, client.CheckpointRequest{ID: fmt.Sprintf("bench-%d", episodes)})
	if o.CPUProfile != "" {
		if perr := profile(ctx, nodes[0], syscall.SIGUSR2, "cpu.pb.gz", filepath.Join(o.CPUProfile, fmt.Sprintf("cpu-%d.pb.gz", episodes))); perr != nil && err == nil {
			return row, perr
		}
	}
	if err != nil {
		var logs strings.Builder
		for _, n := range nodes {
			tail, _ := os.ReadFile(n.log.Name())
			fmt.Fprintf(&logs, "\n%s's log:\n%s", n.name, lastLines(string(tail), 10))
		}
		return row, fmt.Errorf("checkpoint: %w%s", err, logs.String())
	}
	row.CheckpointS = time.Since(t1).Seconds()
	ck, _, err := nodes[0].api.GetCheckpoint(ctx, res.Checkpoint)
	if err != nil {
		return row, err
	}
	if ck.State != store.StateCommitted || ck.Episodes != episodes || ck.Committed == nil {
		return row, fmt.Errorf("checkpoint %s: %s with %d records, want committed with %d", ck.ID, ck.State, ck.Episodes, episodes)
	}
	row.CommitS = ck.Committed.Sub(ck.Created).Seconds()
	say("checkpoint committed: %.2f s (answered in %.2f s)", row.CommitS, row.CheckpointS)
	row.WindowS = time.Since(t1).Seconds() + o.Settle.Seconds()
	select {
	case <-time.After(o.Settle): // pg_stat_database's lag, see statsSettle
	case <-ctx.Done():
		return row, ctx.Err()
	}
	x1, err := xacts(ctx, db)
	if err != nil {
		return row, err
	}
	row.Transactions = x1 - x0
	for i, n := range nodes {
		if row.Memory[i].PeakKiB, err = procKiB(n.cmd.Process.Pid, "VmHWM"); err != nil {
			return row, err
		}
		m := row.Memory[i]
		per := float64(m.StartedKiB-m.BaseKiB) / 1024 / float64(m.Episodes)
		peak := float64(m.PeakKiB-m.BaseKiB) / 1024 / float64(m.Episodes)
		row.MiBPerEpisode = max(row.MiBPerEpisode, per)
		row.PeakMiBPerEpisode = max(row.PeakMiBPerEpisode, peak)
	}
	// Every node's episodes continued: each is running again (checked
	// after the counts: listing reads the store and the supervisors too).
	for i, n := range nodes {
		if err := allRunning(ctx, n, row.Memory[i].Episodes); err != nil {
			return row, err
		}
	}
	return row, nil
}

// episodeRange lists the episode numbers node i of k starts.
func episodeRange(i, k, episodes int) []int {
	var out []int
	for e := i; e < episodes; e += k {
		out = append(out, e)
	}
	return out
}

// allRunning checks that node n drives want episodes and that each one's
// supervisor is running again (none was left paused).
func allRunning(ctx context.Context, n *node, want int) error {
	vs, err := n.api.Episodes(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	running := 0
	for _, v := range vs {
		if !v.Live {
			continue
		}
		if v.Status == nil || v.Status.State != supervisor.StateRunning {
			return fmt.Errorf("%s: episode %s is not running after the checkpoint: %+v %s", n.name, v.ID, v.Status, v.StatusError)
		}
		running++
	}
	if running != want {
		return fmt.Errorf("%s drives %d running episodes after the checkpoint, want %d", n.name, running, want)
	}
	return nil
}

// profile signals node n to write (or end) a profile into STATE/name,
// waits for STATE/name.done and copies the profile to dst.
func profile(ctx context.Context, n *node, sig syscall.Signal, name, dst string) error {
	src := filepath.Join(n.state, name)
	_ = os.Remove(src + ".done")
	if err := n.cmd.Process.Signal(sig); err != nil {
		return err
	}
	deadline := time.Now().Add(time.Minute)
	for {
		if fi, err := os.Stat(src + ".done"); err == nil && fi.Mode().IsRegular() {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s wrote no %s within a minute", n.name, name)
		}
		select {
		case <-time.After(50 * time.Millisecond): // poll interval, bounded by the deadline above
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o644)
}

// storeOnly is the store's part of a checkpoint of episodes over o.Nodes
// nodes, as BenchmarkCheckpointShared measures it: the nodes join, one
// begins the checkpoint, each puts its share of the records 64 at once
// over its own pool, then finishes its share; it returns the seconds from
// the begin to the commit.
func storeOnly(ctx context.Context, o ClusterOptions, episodes int, name string) (float64, error) {
	dsn, drop, err := database(ctx, o.Store, name)
	if err != nil {
		return 0, err
	}
	defer drop()
	views := make([]*store.Postgres, o.Nodes)
	nodes := make([]store.Node, o.Nodes)
	for i := range o.Nodes {
		s, err := store.OpenPostgres(ctx, dsn)
		if err != nil {
			return 0, err
		}
		defer s.Close()
		n, err := s.Join(ctx, fmt.Sprintf("node-%d", i+1), "", 10*time.Minute)
		if err != nil {
			return 0, err
		}
		views[i], nodes[i] = s.AsNode(n), n
	}
	id := "bench-store"
	t0 := time.Now()
	if err := views[0].BeginShared(ctx, id, json.RawMessage(`{"bench":true}`), nodes); err != nil {
		return 0, err
	}
	errs := make([]error, o.Nodes)
	var wg sync.WaitGroup
	for k := range o.Nodes {
		wg.Go(func() {
			mine := episodeRange(k, o.Nodes, episodes)
			sem := make(chan struct{}, 64)
			var mu sync.Mutex
			var inner sync.WaitGroup
			for _, e := range mine {
				sem <- struct{}{}
				inner.Go(func() {
					defer func() { <-sem }()
					ep := fmt.Sprintf("ep-%06d", e)
					w, u := 1796202672.804, 1967.18
					rec := store.Record{
						Episode: ep, Provider: "sim", Sandbox: json.RawMessage(`{"id":"sim-` + ep + `"}`),
						SnapshotID: "simsnap-" + ep, KeepsProcesses: true, PauseSeq: 1, PauseMode: store.PauseHold, PauseConfirmed: true,
						Identity: &store.Identity{PID: 2, StartTime: 7}, PauseWall: &w, PauseUptime: &u,
					}
					if err := views[k].Put(ctx, id, rec); err != nil {
						mu.Lock()
						errs[k] = errors.Join(errs[k], err)
						mu.Unlock()
					}
				})
			}
			inner.Wait()
			if errs[k] == nil {
				_, errs[k] = views[k].FinishShare(ctx, id, nodes[k].Name, len(mine), "")
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	took := time.Since(t0).Seconds()
	c, _, err := views[0].Get(ctx, id)
	if err != nil {
		return 0, err
	}
	if c.State != store.StateCommitted || c.Episodes != episodes {
		return 0, fmt.Errorf("the store-only checkpoint ended %s with %d records, want committed with %d", c.State, c.Episodes, episodes)
	}
	return took, nil
}
