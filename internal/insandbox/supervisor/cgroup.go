package supervisor

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// CgroupRoot is where the supervisor looks for the cgroup v2 file system.
const CgroupRoot = "/sys/fs/cgroup"

// ShimCgroupEnv carries the harness's control group directory from the
// supervisor to its shim, which starts the harness inside it
// (CLONE_INTO_CGROUP): no process of the tree exists outside it, even for
// an instant.
const ShimCgroupEnv = "STASIS_SHIM_CGROUP"

// freezer is the control group of the harness tree for hold+freeze: a
// child of the supervisor's own group, frozen and thawed through
// cgroup.freeze, its state read from cgroup.events.
type freezer struct {
	dir string
}

// newFreezer makes the harness's control group under the supervisor's own,
// named after the supervisor's pid (which an in-place restore keeps). It
// says plainly why when there is no writable cgroup v2 file system.
func newFreezer(root string) (*freezer, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return nil, fmt.Errorf("hold+freeze needs the cgroup v2 file system at %s: %w", root, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return nil, fmt.Errorf("hold+freeze needs the cgroup v2 file system at %s, and none is mounted there (cgroup v1 or no cgroup file system in this sandbox)", root)
	}
	own, err := ownCgroup("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(root, own, fmt.Sprintf("stasis-harness-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("hold+freeze: make the harness's control group %s: %w (the cgroup file system is not writable here)", dir, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.freeze")); err != nil {
		_ = os.Remove(dir)
		return nil, fmt.Errorf("hold+freeze: the control group %s has no freezer (cgroup.freeze): %w", dir, err)
	}
	return &freezer{dir: dir}, nil
}

// ownCgroup reads the unified hierarchy's path ("0::/PATH") from a
// /proc/PID/cgroup file.
func ownCgroup(file string) (string, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			if !strings.HasPrefix(p, "/") || strings.Contains(p, "..") {
				return "", fmt.Errorf("%s: unexpected cgroup path %q", file, p)
			}
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: no cgroup v2 entry (0::)", file)
}

// set writes cgroup.freeze.
func (f *freezer) set(v string) error {
	if err := os.WriteFile(filepath.Join(f.dir, "cgroup.freeze"), []byte(v), 0); err != nil {
		return fmt.Errorf("write %s/cgroup.freeze: %w", f.dir, err)
	}
	return nil
}

// frozen reads "frozen" from cgroup.events.
func (f *freezer) frozen() (bool, error) {
	b, err := os.ReadFile(filepath.Join(f.dir, "cgroup.events"))
	if err != nil {
		return false, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "frozen "); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			return n == 1, err
		}
	}
	return false, fmt.Errorf("%s/cgroup.events has no frozen field", f.dir)
}

// Freeze asks the kernel to freeze the group and polls cgroup.events until
// it says frozen, or timeout passes.
func (f *freezer) Freeze(timeout time.Duration) (bool, string, error) {
	if err := f.set("1"); err != nil {
		return false, "", err
	}
	deadline := time.Now().Add(timeout)
	for wait := 50 * time.Microsecond; ; wait = min(wait*2, 5*time.Millisecond) {
		ok, err := f.frozen()
		if err != nil {
			return false, "", err
		}
		if ok {
			return true, "", nil
		}
		if time.Now().After(deadline) {
			return false, fmt.Sprintf("the harness's control group was not frozen within %s (a process in uninterruptible sleep?): %s", timeout, f.members()), nil
		}
		time.Sleep(wait)
	}
}

// Thaw undoes Freeze.
func (f *freezer) Thaw() error { return f.set("0") }

// members names the group's processes, for a note.
func (f *freezer) members() string {
	b, _ := os.ReadFile(filepath.Join(f.dir, "cgroup.procs"))
	return "processes " + strings.Join(strings.Fields(string(b)), ",")
}

// Remove removes the (empty) group.
func (f *freezer) Remove() error {
	_ = f.set("0")
	if err := os.Remove(f.dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove the harness's control group %s: %w", f.dir, err)
	}
	return nil
}
