package local

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/storage/atomicfile"
	"stasis/sandbox"
)

// Limits. Every sandbox gets a control group of its own, made by the
// provider before its keeper starts, which the keeper joins before it
// starts bubblewrap (so everything in the sandbox is in it) and which every
// exec joins before it enters the sandbox: pids (a fork bomb), memory (a
// hog; swap counted too where the kernel can) and a CPU weight (a fair
// share against the other sandboxes). cgroup v2 is used where its
// controllers are enabled, else the v1 hierarchies (this machine's kind).
// /dev/shm is a tmpfs of its own with a size. The writable places sit on
// the host's disk; their use is counted by the keeper, every
// diskCheckEvery, and a sandbox over its limit is ended like one over its
// memory: project quotas would need a file system mounted with them, and a
// size-limited file system (a loop image) per sandbox costs its setup and
// its own snapshot path, while a count costs a walk of the tree.
//
// Exceeding a limit ends that sandbox, and only it: its keeper records the
// reason (DIR/limit.json) and kills it, and from then on the provider
// answers for the sandbox with that reason.

// DefaultLimits are the limits of a sandbox whose spec and provider name
// none.
var DefaultLimits = sandbox.Limits{
	Pids:        4096,
	MemoryBytes: 4 << 30,
	CPUWeight:   100,
	ShmBytes:    64 << 20,
	DiskBytes:   16 << 30,
}

// diskCheckEvery is how often a keeper counts its sandbox's disk use, and
// eventCheckEvery how often it reads its control group's events.
const (
	diskCheckEvery  = 5 * time.Second
	eventCheckEvery = 250 * time.Millisecond
)

// limitFile records why a keeper ended its sandbox.
const limitFile = "limit.json"

// limitReason is DIR/limit.json.
type limitReason struct {
	Limit  string    `json:"limit"` // pids, memory, disk
	Reason string    `json:"reason"`
	At     time.Time `json:"at"`
}

// withDefaults fills l's zero fields from d.
func withDefaults(l, d sandbox.Limits) sandbox.Limits {
	if l.Pids == 0 {
		l.Pids = d.Pids
	}
	if l.MemoryBytes == 0 {
		l.MemoryBytes = d.MemoryBytes
	}
	if l.CPUWeight == 0 {
		l.CPUWeight = d.CPUWeight
	}
	if l.ShmBytes == 0 {
		l.ShmBytes = d.ShmBytes
	}
	if l.DiskBytes == 0 {
		l.DiskBytes = d.DiskBytes
	}
	return l
}

// checkLimits refuses limits no sandbox could run under.
func checkLimits(l sandbox.Limits) error { return l.Check() }

// cgroupDirs are a sandbox's control group directories, one per v1
// hierarchy (pids, memory, cpu) or one for v2.
type cgroups struct {
	V2   bool     `json:"v2,omitempty"`
	Dirs []string `json:"dirs"`
}

// cgroupLayout finds where a sandbox's control groups go: under the
// provider process's own, in a "stasis" group.
func cgroupLayout() (v2 bool, parents map[string]string, err error) {
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return false, nil, err
	}
	paths := map[string]string{} // controller (or "" for v2) → path
	for _, line := range strings.Split(strings.TrimSpace(string(own)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[1] == "" {
			paths[""] = parts[2]
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			paths[c] = parts[2]
		}
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		have := strings.Fields(string(b))
		if contains(have, "pids") && contains(have, "memory") {
			return true, map[string]string{"": filepath.Join("/sys/fs/cgroup", paths[""], "stasis")}, nil
		}
	}
	mounts, err := v1Mounts()
	if err != nil {
		return false, nil, err
	}
	parents = map[string]string{}
	for _, c := range []string{"pids", "memory", "cpu"} {
		m, ok := mounts[c]
		if !ok {
			return false, nil, fmt.Errorf("no cgroup v2 with the pids and memory controllers, and no v1 %s hierarchy mounted: the sandboxes cannot be limited", c)
		}
		parents[c] = filepath.Join(m, paths[c], "stasis")
	}
	return false, parents, nil
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// v1Mounts maps each v1 controller to its hierarchy's mount point.
func v1Mounts() (map[string]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+3 >= len(f) || f[sep+1] != "cgroup" || f[3] != "/" {
			continue
		}
		for _, opt := range strings.Split(f[sep+3], ",") {
			switch opt {
			case "pids", "memory", "cpu":
				out[opt] = f[4]
			}
		}
	}
	return out, sc.Err()
}

// makeCgroups makes sandbox id's control groups with limits l.
func makeCgroups(id string, l sandbox.Limits) (cgroups, error) {
	v2, parents, err := cgroupLayout()
	if err != nil {
		return cgroups{}, err
	}
	cg := cgroups{V2: v2}
	write := func(dir, file, value string) error {
		if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644); err != nil {
			return fmt.Errorf("cgroup %s: set %s to %s: %w", dir, file, value, err)
		}
		return nil
	}
	fail := func(err error) (cgroups, error) {
		removeCgroups(cg)
		return cgroups{}, err
	}
	if v2 {
		parent := parents[""]
		if err := os.MkdirAll(parent, 0o755); err != nil {
			return cgroups{}, fmt.Errorf("cgroup: %w", err)
		}
		// The controllers must be on for the children of "stasis" (and of
		// its parent, which holds it).
		for _, d := range []string{filepath.Dir(parent), parent} {
			if err := os.WriteFile(filepath.Join(d, "cgroup.subtree_control"), []byte("+pids +memory +cpu"), 0o644); err != nil {
				return cgroups{}, fmt.Errorf("cgroup v2: enable pids, memory and cpu below %s: %w (a cgroup that holds processes cannot delegate them: run stasis in a cgroup of its own)", d, err)
			}
		}
		dir := filepath.Join(parent, id)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return cgroups{}, fmt.Errorf("cgroup: %w", err)
		}
		cg.Dirs = []string{dir}
		for _, s := range [][2]string{
			{"pids.max", strconv.Itoa(l.Pids)},
			{"memory.max", strconv.FormatInt(l.MemoryBytes, 10)},
			{"memory.swap.max", "0"},
			{"cpu.weight", strconv.Itoa(l.CPUWeight)},
		} {
			if err := write(dir, s[0], s[1]); err != nil && !(s[0] == "memory.swap.max" && errors.Is(err, fs.ErrNotExist)) {
				return fail(err)
			}
		}
		return cg, nil
	}
	for _, c := range []string{"pids", "memory", "cpu"} {
		if err := os.MkdirAll(parents[c], 0o755); err != nil {
			return fail(fmt.Errorf("cgroup: %w", err))
		}
		dir := filepath.Join(parents[c], id)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return fail(fmt.Errorf("cgroup: %w", err))
		}
		cg.Dirs = append(cg.Dirs, dir)
		var err error
		switch c {
		case "pids":
			err = write(dir, "pids.max", strconv.Itoa(l.Pids))
		case "memory":
			if err = write(dir, "memory.limit_in_bytes", strconv.FormatInt(l.MemoryBytes, 10)); err == nil {
				// Memory and swap together, where swap is accounted.
				if werr := write(dir, "memory.memsw.limit_in_bytes", strconv.FormatInt(l.MemoryBytes, 10)); werr != nil && !errors.Is(werr, fs.ErrNotExist) {
					err = werr
				}
			}
		case "cpu":
			err = write(dir, "cpu.shares", strconv.Itoa(max(2, l.CPUWeight*1024/100)))
		}
		if err != nil {
			return fail(err)
		}
	}
	return cg, nil
}

// procsFiles are the files a process writes its pid to, to join.
func (cg cgroups) procsFiles() []string {
	out := make([]string, len(cg.Dirs))
	for i, d := range cg.Dirs {
		out[i] = filepath.Join(d, "cgroup.procs")
	}
	return out
}

// join moves the calling process into the sandbox's control groups.
func (cg cgroups) join() error {
	pid := []byte(strconv.Itoa(os.Getpid()))
	for _, f := range cg.procsFiles() {
		if err := os.WriteFile(f, pid, 0o644); err != nil {
			return fmt.Errorf("join %s: %w", f, err)
		}
	}
	return nil
}

// removeCgroups removes a sandbox's control groups once their processes
// are gone (they are being killed: it waits up to 10 s for that).
func removeCgroups(cg cgroups) {
	deadline := time.Now().Add(10 * time.Second)
	for _, d := range cg.Dirs {
		for {
			err := syscall.Rmdir(d)
			if err == nil || errors.Is(err, fs.ErrNotExist) || !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
		}
	}
}

// exceeded reads the control groups' events: which limit was hit, if one
// was (a pids limit refused a fork, the memory limit made the kernel kill
// a process).
func (cg cgroups) exceeded(l sandbox.Limits) (limit, reason string) {
	read := func(dir, file, key string) int64 {
		b, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil {
			return 0
		}
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, " "); ok && k == key {
				n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				return n
			}
		}
		return 0
	}
	for _, d := range cg.Dirs {
		pidsFile, memFile := "pids.events", "memory.events"
		if !cg.V2 {
			memFile = "memory.oom_control"
		}
		if n := read(d, pidsFile, "max"); n > 0 {
			return "pids", fmt.Sprintf("the sandbox tried to run more than its %d processes (%d forks refused)", l.Pids, n)
		}
		if n := read(d, memFile, "oom_kill"); n > 0 {
			return "memory", fmt.Sprintf("the sandbox went over its memory limit of %d MiB (%d processes killed by the kernel)", l.MemoryBytes>>20, n)
		}
	}
	return "", ""
}

// diskUse counts the bytes the files under root take on disk, not
// following links (the writable places of one sandbox).
func diskUse(root string) int64 {
	var n int64
	_ = filepath.WalkDir(root, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // gone since, or unreadable: count the rest
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}

// watchLimits is the keeper's watch over its sandbox's limits: on the
// first limit exceeded it records the reason in DIR/limit.json and calls
// end (which kills the sandbox); it returns when stop is closed.
func watchLimits(dir string, m meta, stop <-chan struct{}, end func()) {
	events := time.NewTicker(eventCheckEvery)
	defer events.Stop()
	disk := time.NewTicker(diskCheckEvery)
	defer disk.Stop()
	record := func(limit, reason string) {
		_ = atomicfile.WriteJSON(filepath.Join(dir, limitFile), limitReason{Limit: limit, Reason: reason, At: time.Now().UTC()}, 0o600)
		end()
	}
	for {
		select {
		case <-stop:
			return
		case <-events.C:
			if limit, reason := m.Cgroups.exceeded(m.Limits); limit != "" {
				record(limit, reason)
				return
			}
		case <-disk.C:
			if use := diskUse(filepath.Join(dir, rootDir)); use > m.Limits.DiskBytes {
				record("disk", fmt.Sprintf("the sandbox's files took %d MiB of disk, over its limit of %d MiB", use>>20, m.Limits.DiskBytes>>20))
				return
			}
		}
	}
}

// endedByLimit is a conflict when sandbox m's keeper ended it for a
// limit it exceeded (the reason it recorded), else nil.
func (p *Provider) endedByLimit(op string, m meta) error {
	r, err := hostkeep.ReadJSON[limitReason](filepath.Join(p.sbDir(m.ID), limitFile))
	if err != nil || r.Reason == "" {
		return nil
	}
	return sandbox.Errorf(errdefs.ErrConflict, op, what(m.ID), "it was ended at %s for exceeding its %s limit: %s; delete it", r.At.Format(time.RFC3339), r.Limit, r.Reason)
}
