package hostkeep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/proc"
	"stasis/sandbox"
)

// A provider's own meta and keeper record, as the providers declare
// theirs.
type tmeta struct {
	Meta
	Own  string   `json:"own,omitempty"`
	Disk []string `json:"disk,omitempty"` // what Sandboxes.Uses says
}

type tkeeper struct {
	Keeper proc.Identity `json:"keeper"`
	Main   proc.Identity `json:"main"`
}

// The test binary is also a keeper (StartKeeper's tests) and a writer of
// meta.json in another process (the lock's test), when these say so.
const (
	keeperEnv  = "STASIS_HOSTKEEP_TEST_KEEPER"  // "run": write keeper.json and wait; "fail": exit
	rewriteEnv = "STASIS_HOSTKEEP_TEST_REWRITE" // DIR ID N: add N labels to ID's meta
)

func TestMain(m *testing.M) {
	switch {
	case os.Getenv(keeperEnv) == "run":
		self, err := proc.Self()
		if err == nil {
			err = writeJSON(filepath.Join(os.Args[len(os.Args)-1], KeeperFile), tkeeper{Keeper: self, Main: self})
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM)
		<-stop // or SIGKILL
		os.Exit(0)
	case os.Getenv(keeperEnv) == "fail":
		fmt.Fprintln(os.Stderr, "the keeper gives up")
		os.Exit(3)
	case os.Getenv(rewriteEnv) != "":
		f := strings.Fields(os.Getenv(rewriteEnv))
		n, _ := strconv.Atoi(f[2])
		s := &Sandboxes[tmeta, *tmeta, tkeeper]{Provider: "test", Dir: f[0], Prefix: "sb-"}
		for i := range n {
			if err := addLabel(s, f[1], "proc-"+strconv.Itoa(i)); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}

func addLabel(s *Sandboxes[tmeta, *tmeta, tkeeper], id, key string) error {
	_, err := s.Rewrite("label", id, func(m *tmeta) error {
		if m.Labels == nil {
			m.Labels = map[string]string{}
		}
		m.Labels[key] = "1"
		return nil
	})
	return err
}

// rig is a state directory of sandboxes whose keeper and main process
// are this test process (or, for lost ones, an identity that is no
// process's), and a clock that only the test moves.
type rig struct {
	t    *testing.T
	s    *Sandboxes[tmeta, *tmeta, tkeeper]
	c    Calls[tmeta, *tmeta, tkeeper, SnapMeta, *SnapMeta] // of s alone
	now  time.Time
	self proc.Identity
}

func newRig(t *testing.T) *rig {
	self, err := proc.Self()
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC), self: self}
	r.s = &Sandboxes[tmeta, *tmeta, tkeeper]{
		Provider: "test", Flag: " --provider test", Dir: t.TempDir(), Prefix: "sb-",
		Now:   func() time.Time { return r.now },
		Procs: func(k tkeeper) (proc.Identity, proc.Identity) { return k.Keeper, k.Main },
		Runs:  "the sandbox", Lost: "keeper",
		Ended: func(op string, m tmeta) error {
			if m.Own == "ended" {
				return sandbox.Errorf(errdefs.ErrConflict, op, "sandbox "+m.ID, "ended by the test")
			}
			return nil
		},
		Info: func(m tmeta, state sandbox.State) sandbox.Info { return m.Info("test", state) },
		Uses: func(m tmeta) []string { return m.Disk },
	}
	r.c = NewCalls(r.s, (*Snapshots[SnapMeta, *SnapMeta])(nil))
	return r
}

// dead is an identity no process has: this process's PID, another start.
func (r *rig) dead() proc.Identity {
	return proc.Identity{PID: r.self.PID, StartTime: r.self.StartTime + 1}
}

// add makes a sandbox, created age before now, expiring in ttl, with a
// keeper record naming keeper (none when zero).
func (r *rig) add(age, ttl time.Duration, labels map[string]string, own string, keeper proc.Identity) string {
	r.t.Helper()
	m := tmeta{Meta: Meta{ID: NewID("sb-"), Labels: labels, Created: r.now.Add(-age), Expiry: r.now.Add(ttl)}, Own: own}
	if err := os.Mkdir(r.s.Path(m.ID), 0o700); err != nil {
		r.t.Fatal(err)
	}
	if err := r.s.Write(m); err != nil {
		r.t.Fatal(err)
	}
	if keeper != (proc.Identity{}) {
		if err := writeJSON(filepath.Join(r.s.Path(m.ID), KeeperFile), tkeeper{Keeper: keeper, Main: keeper}); err != nil {
			r.t.Fatal(err)
		}
	}
	return m.ID
}

func (r *rig) read(id string) tmeta {
	r.t.Helper()
	m, err := r.s.Read("test", id)
	if err != nil {
		r.t.Fatal(err)
	}
	return m
}

// A provider's meta is one flat JSON object, as it was before Meta was
// shared: meta.json files written then read the same.
func TestMetaIsFlat(t *testing.T) {
	old := `{"id":"sb-0123456789abcdef","labels":{"a":"b"},"created":"2030-01-02T03:04:05Z","expiry":"2030-01-02T04:04:05Z","last_manifest":"m1","own":"x"}`
	var m tmeta
	if err := json.Unmarshal([]byte(old), &m); err != nil {
		t.Fatal(err)
	}
	if m.ID != "sb-0123456789abcdef" || m.Labels["a"] != "b" || m.LastManifest != "m1" || m.Own != "x" || m.Expiry.Hour() != 4 {
		t.Fatalf("read %+v", m)
	}
	b, _ := json.Marshal(m)
	var flat map[string]any
	if err := json.Unmarshal(b, &flat); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"id", "labels", "created", "expiry", "last_manifest", "own"} {
		if _, ok := flat[k]; !ok {
			t.Fatalf("%s is not a member of %s", k, b)
		}
	}
}

// List: every sandbox that carries the labels, oldest first, with its
// state: running, expired (by the clock or by the keeper's mark), lost (its
// keeper gone, never written, or the provider's Ended); an unreadable
// meta.json, a retiring directory and other entries are left out.
func TestListStates(t *testing.T) {
	r := newRig(t)
	team := map[string]string{"team": "a"}
	running := r.add(5*time.Minute, time.Hour, map[string]string{"team": "a", "x": "y"}, "", r.self)
	expired := r.add(4*time.Minute, -time.Second, team, "", r.self)
	marked := r.add(3*time.Minute, time.Hour, team, "", r.self)
	if err := os.WriteFile(filepath.Join(r.s.Path(marked), ExpiredFile), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	dead := r.add(2*time.Minute, time.Hour, team, "", r.dead())
	never := r.add(time.Minute, time.Hour, team, "", proc.Identity{})
	ended := r.add(30*time.Second, time.Hour, team, "ended", r.self)
	r.add(6*time.Minute, time.Hour, map[string]string{"team": "b"}, "", r.self)
	bad := NewID("sb-")
	for _, d := range []string{bad, ".retiring-" + running + "-x", "not-a-sandbox"} {
		if err := os.Mkdir(filepath.Join(r.s.Dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(r.s.Path(bad), MetaFile), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := r.c
	infos, err := c.List(context.Background(), team)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		id    string
		state sandbox.State
	}{{running, sandbox.StateRunning}, {expired, sandbox.StateExpired}, {marked, sandbox.StateExpired},
		{dead, sandbox.StateLost}, {never, sandbox.StateLost}, {ended, sandbox.StateLost}}
	if len(infos) != len(want) {
		t.Fatalf("listed %d sandboxes, want %d: %+v", len(infos), len(want), infos)
	}
	for i, w := range want {
		if infos[i].ID != w.id || infos[i].State != w.state || infos[i].Provider != "test" {
			t.Errorf("#%d: %s %s, want %s %s", i, infos[i].ID, infos[i].State, w.id, w.state)
		}
	}
	all, err := c.List(context.Background(), nil)
	if err != nil || len(all) != 7 {
		t.Fatalf("without labels: %d sandboxes (%v), want 7", len(all), err)
	}
}

// Get: a running sandbox; an expired one described, with ErrExpired; a
// lost one ErrConflict; a missing or malformed id ErrNotFound, whose
// message names the provider's flag.
func TestGet(t *testing.T) {
	r := newRig(t)
	c := r.c
	ctx := context.Background()
	run := r.add(0, time.Hour, nil, "", r.self)
	if in, err := c.Get(ctx, run); err != nil || in.State != sandbox.StateRunning || in.ID != run {
		t.Fatalf("running: %+v %v", in, err)
	}
	exp := r.add(0, -time.Minute, nil, "", r.self)
	if in, err := c.Get(ctx, exp); !errors.Is(err, errdefs.ErrExpired) || in.State != sandbox.StateExpired || in.ID != exp {
		t.Fatalf("expired: %+v %v", in, err)
	}
	lost := r.add(0, time.Hour, nil, "", r.dead())
	if _, err := c.Get(ctx, lost); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "its keeper is not running") {
		t.Fatalf("lost: %v", err)
	}
	for _, id := range []string{NewID("sb-"), "sb-../../etc", "vm-0123456789abcdef"} {
		if _, err := c.Get(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s: %v", id, err)
		}
	}
	if _, err := c.Get(ctx, NewID("sb-")); !strings.Contains(err.Error(), "`stasis sandbox ls --provider test`") {
		t.Fatalf("the message: %v", err)
	}
}

// SetExpiry: the new expiry is written and the keeper told (SIGHUP); one
// not in the future, or a sandbox that no longer runs, is refused with
// nothing written.
func TestSetExpiry(t *testing.T) {
	hups := make(chan os.Signal, 16)
	signal.Notify(hups, syscall.SIGHUP) // this process is the keeper
	defer signal.Stop(hups)
	r := newRig(t)
	c := r.c
	ctx := context.Background()
	id := r.add(0, time.Hour, nil, "", r.self)
	later := r.now.Add(2 * time.Hour).In(time.FixedZone("x", 3600))
	if err := c.SetExpiry(ctx, id, later); err != nil {
		t.Fatal(err)
	}
	if m := r.read(id); !m.Expiry.Equal(later) || m.Expiry.Location() != time.UTC {
		t.Fatalf("expiry %v, want %v in UTC", m.Expiry, later)
	}
	select {
	case <-hups:
	case <-time.After(30 * time.Second):
		t.Fatal("the keeper was not told")
	}
	if err := c.SetExpiry(ctx, id, r.now); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("an expiry now: %v", err)
	}
	r.now = r.now.Add(3 * time.Hour)
	if err := c.SetExpiry(ctx, id, r.now.Add(time.Hour)); !errors.Is(err, errdefs.ErrExpired) {
		t.Fatalf("an expired sandbox: %v", err)
	}
	lost := r.add(0, time.Hour, nil, "", r.dead())
	if err := c.SetExpiry(ctx, lost, r.now.Add(2*time.Hour)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a lost sandbox: %v", err)
	}
	if m := r.read(lost); !m.Expiry.Equal(r.now.Add(time.Hour)) {
		t.Fatalf("a refused SetExpiry wrote %v", m.Expiry)
	}
	if err := c.SetExpiry(ctx, NewID("sb-"), r.now.Add(time.Hour)); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a missing sandbox: %v", err)
	}
}

// Every rewrite of meta.json is under the sandbox's lock: SetExpiry,
// SetBase and Rewrite from many goroutines and from another process at
// once lose none of each other's changes.
func TestRewritesUnderTheLock(t *testing.T) {
	hups := make(chan os.Signal, 256)
	signal.Notify(hups, syscall.SIGHUP)
	defer signal.Stop(hups)
	r := newRig(t)
	c := r.c
	id := r.add(0, time.Hour, nil, "", r.self)

	const perProc = 40
	other := exec.Command(os.Args[0], "-test.run=^$")
	other.Env = append(os.Environ(), rewriteEnv+"="+r.s.Dir+" "+id+" "+strconv.Itoa(perProc))
	var otherOut strings.Builder
	other.Stdout, other.Stderr = &otherOut, &otherOut
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	expiries := map[time.Time]bool{}
	var wg sync.WaitGroup
	for g := range 4 {
		e := r.now.Add(time.Duration(g+2) * time.Hour)
		expiries[e] = true
		wg.Add(3)
		go func() {
			defer wg.Done()
			for i := range perProc {
				if err := addLabel(r.s, id, fmt.Sprintf("g%d-%d", g, i)); err != nil {
					t.Error(err)
				}
			}
		}()
		go func() {
			defer wg.Done()
			for range perProc {
				if err := c.SetExpiry(context.Background(), id, e); err != nil {
					t.Error(err)
				}
			}
		}()
		go func() {
			defer wg.Done()
			for i := range perProc / 4 {
				if err := r.s.SetBase(id, fmt.Sprintf("m%d-%d", g, i)); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	if err := other.Wait(); err != nil {
		t.Fatalf("the other process: %v: %s", err, otherOut.String())
	}
	m := r.read(id)
	if want := 4*perProc + perProc; len(m.Labels) != want {
		t.Fatalf("%d labels, want %d: rewrites were lost", len(m.Labels), want)
	}
	if !expiries[m.Expiry] || !strings.HasPrefix(m.LastManifest, "m") {
		t.Fatalf("expiry %v, base %q: not one that was set", m.Expiry, m.LastManifest)
	}
}

// SetBase records a snapshot's manifest, and leaves a sandbox gone
// meanwhile (or never there) as it is, without an error.
func TestSetBase(t *testing.T) {
	r := newRig(t)
	id := r.add(0, time.Hour, nil, "", r.self)
	if err := r.s.SetBase(id, "m1"); err != nil || r.read(id).LastManifest != "m1" {
		t.Fatalf("%v %q", err, r.read(id).LastManifest)
	}
	if err := r.s.SetBase(NewID("sb-"), "m2"); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(r.s.Dir); len(ents) != 1 {
		t.Fatalf("SetBase of a missing sandbox made %v", ents)
	}
}

// Rebase changes the incremental base and what Uses reads at once;
// Bases are both, without empty ones.
func TestRebase(t *testing.T) {
	r := newRig(t)
	id := r.add(0, time.Hour, nil, "", r.self)
	if got := r.s.Bases(r.read(id)); len(got) != 0 {
		t.Fatalf("bases of a new sandbox: %v", got)
	}
	if err := r.s.Rebase(id, func(m *tmeta) { m.LastManifest, m.Disk = "m1", []string{"d1", ""} }); err != nil {
		t.Fatal(err)
	}
	if got := r.s.Bases(r.read(id)); fmt.Sprint(got) != "[m1 d1]" {
		t.Fatalf("bases after Rebase: %v", got)
	}
	if err := r.s.SetBase(id, "m2"); err != nil {
		t.Fatal(err)
	}
	if got := r.s.Bases(r.read(id)); fmt.Sprint(got) != "[m2 d1]" {
		t.Fatalf("bases after SetBase: %v", got)
	}
}

// GC retires the sandboxes whose keeper is dead, and those without a
// keeper record a minute old; it finishes a retiring directory; it leaves
// running sandboxes, expired ones whose keeper runs, and young ones.
func TestGC(t *testing.T) {
	r := newRig(t)
	live := r.add(0, time.Hour, nil, "", r.self)
	expiredButKept := r.add(0, -time.Hour, nil, "", r.self)
	dead := r.add(0, time.Hour, nil, "", r.dead())
	young := r.add(0, time.Hour, nil, "", proc.Identity{})
	old := r.add(0, time.Hour, nil, "", proc.Identity{})
	long := time.Now().Add(-2 * time.Minute)
	if err := os.Chtimes(r.s.Path(old), long, long); err != nil {
		t.Fatal(err)
	}
	retiring := ".retiring-" + NewID("sb-") + "-" + NewID("")
	if err := os.Mkdir(filepath.Join(r.s.Dir, retiring), 0o700); err != nil {
		t.Fatal(err)
	}
	var finished []string
	var retired []string
	reaped, err := r.s.GC(func(dead, id string) { finished = append(finished, filepath.Base(dead)+" "+id) }, func(id string) error {
		retired = append(retired, id)
		return r.s.Retire(id, func(string) {})
	})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(reaped) != fmt.Sprint(retired) || len(reaped) != 2 || !contains(reaped, dead) || !contains(reaped, old) {
		t.Fatalf("reaped %v (retired %v), want %s and %s", reaped, retired, dead, old)
	}
	if len(finished) != 1 || !strings.HasPrefix(finished[0], retiring+" sb-") {
		t.Fatalf("finished %v", finished)
	}
	c := r.c
	if c.Retired(dead) != 1 || c.Retired(live) != 0 {
		t.Fatalf("Retired: %d %d", c.Retired(dead), c.Retired(live))
	}
	for _, id := range []string{live, expiredButKept, young} {
		if _, err := os.Stat(r.s.Path(id)); err != nil {
			t.Fatalf("%s was taken: %v", id, err)
		}
	}
	if _, err := os.Stat(filepath.Join(r.s.Dir, retiring)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the retiring directory is left: %v", err)
	}
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// Manifests are every directory's bases (its incremental base and what
// Uses says), a retiring one's too.
func TestManifests(t *testing.T) {
	r := newRig(t)
	a := r.add(0, time.Hour, nil, "", r.self)
	r.add(0, time.Hour, nil, "", r.self) // no base
	if err := r.s.SetBase(a, "m1"); err != nil {
		t.Fatal(err)
	}
	b := r.add(0, time.Hour, nil, "", r.self)
	if err := r.s.Rebase(b, func(m *tmeta) { m.LastManifest, m.Disk = "m2", []string{"d2"} }); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(r.s.Path(b), filepath.Join(r.s.Dir, ".retiring-"+b+"-x")); err != nil {
		t.Fatal(err)
	}
	got, err := r.s.Manifests()
	if err != nil || len(got) != 3 || !contains(got, "m1") || !contains(got, "m2") || !contains(got, "d2") {
		t.Fatalf("%v %v", got, err)
	}
}

// StartKeeper returns once the keeper it started wrote its record; a
// keeper that exits first is an error quoting its log.
func TestStartKeeper(t *testing.T) {
	r := newRig(t)
	id := r.add(0, time.Hour, nil, "", proc.Identity{})
	cmd := exec.Command(os.Args[0], "-test.run=^$", r.s.Path(id))
	cmd.Env = append(os.Environ(), keeperEnv+"=run")
	if err := r.s.StartKeeper(context.Background(), id, cmd); err != nil {
		t.Fatal(err)
	}
	k, ok := KeeperAt[tkeeper](r.s.Path(id))
	if !ok || k.Keeper.PID != cmd.Process.Pid || !proc.Alive(k.Keeper) {
		t.Fatalf("keeper record %+v (%v), keeper pid %d", k, ok, cmd.Process.Pid)
	}
	KillAndWait(k.Keeper)

	fails := r.add(0, time.Hour, nil, "", proc.Identity{})
	cmd = exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), keeperEnv+"=fail")
	err := r.s.StartKeeper(context.Background(), fails, cmd)
	if err == nil || !strings.Contains(err.Error(), "exited before the sandbox ran") || !strings.Contains(err.Error(), "the keeper gives up") {
		t.Fatalf("a keeper that failed: %v", err)
	}
}

// CheckSpec refuses an expiry not in the future and a seed that is not a
// directory.
func TestCheckSpec(t *testing.T) {
	now := time.Now()
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		spec sandbox.Spec
		ok   bool
	}{
		{sandbox.Spec{Expiry: now.Add(time.Hour)}, true},
		{sandbox.Spec{Expiry: now.Add(time.Hour), Root: t.TempDir()}, true},
		{sandbox.Spec{}, false},
		{sandbox.Spec{Expiry: now}, false},
		{sandbox.Spec{Expiry: now.Add(time.Hour), Root: file}, false},
		{sandbox.Spec{Expiry: now.Add(time.Hour), Root: file + "-missing"}, false},
	} {
		err := CheckSpec(tc.spec, now)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, errdefs.ErrInvalid)) {
			t.Errorf("%+v: %v", tc.spec, err)
		}
	}
}
