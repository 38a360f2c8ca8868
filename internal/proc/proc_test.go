package proc

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestParseStatTable(t *testing.T) {
	tail := " S 1 100 100 0 -1 4194560 119 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10 18446744073709551615"
	cases := []struct {
		name, line, comm string
		start            uint64
		state            byte
		ppid             int
	}{
		{"plain", "42 (sleep)" + tail, "sleep", 987654, 'S', 1},
		{"space", "42 (my prog)" + tail, "my prog", 987654, 'S', 1},
		{"parens", "42 (a) (b))" + tail, "a) (b)", 987654, 'S', 1},
		{"closing paren and digits", "42 (x) 1 2 3)" + tail, "x) 1 2 3", 987654, 'S', 1},
		{"empty comm", "42 ()" + tail, "", 987654, 'S', 1},
		{"trailing newline", "42 (sh)" + tail + "\n", "sh", 987654, 'S', 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, err := ParseStat([]byte(c.line))
			if err != nil {
				t.Fatal(err)
			}
			if s.PID != 42 || s.Comm != c.comm || s.StartTime != c.start || s.State != c.state || s.PPID != c.ppid {
				t.Fatalf("got %+v", s)
			}
		})
	}
}

func TestParseStatRejects(t *testing.T) {
	for _, line := range []string{
		"", "42", "42 (x", "x (y) S 1 2 3", "42 (x) S 1 2",
		"42 (x) SS 1 100 100 0 -1 4194560 119 0 0 0 0 0 0 0 20 0 1 0 5",
		"42 (x) S 1 100 100 0 -1 4194560 119 0 0 0 0 0 0 0 20 0 1 0 -5",
		"-3 (x) S 1 100 100 0 -1 4194560 119 0 0 0 0 0 0 0 20 0 1 0 5",
	} {
		if _, err := ParseStat([]byte(line)); err == nil {
			t.Errorf("ParseStat(%q) accepted", line)
		}
	}
}

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("42 (sleep) S 1 100 100 0 -1 4194560 119 0 0 0 0 0 0 0 20 0 1 0 987654 1000"))
	f.Add([]byte("1 ((a b)) R 0 0 0 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 1 1"))
	f.Add([]byte(")("))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseStat(b)
		if err == nil && s.PID <= 0 {
			t.Fatalf("accepted pid %d", s.PID)
		}
	})
}

// TestIdentityMatchesProc compares Self with what /proc says, read by hand.
func TestIdentityMatchesProc(t *testing.T) {
	id, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if id.PID != os.Getpid() || f[19] != strconv.FormatUint(id.StartTime, 10) {
		t.Fatalf("identity %v, /proc field 22 %s", id, f[19])
	}
	if !Alive(id) {
		t.Fatal("self not alive")
	}
	if Alive(Identity{PID: id.PID, StartTime: id.StartTime + 1}) {
		t.Fatal("a different start time must not match")
	}
}

// TestCommWithParens runs a real process whose name holds spaces and
// parentheses and reads its identity.
func TestCommWithParens(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "a) (b c")
	if err := os.Symlink("/bin/sleep", name); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(name, "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	s, err := ReadStat(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if s.Comm != "a) (b c" || s.PPID != os.Getpid() {
		t.Fatalf("got %+v", s)
	}
	desc, err := Descendants(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, d := range desc {
		found = found || d.PID == cmd.Process.Pid
	}
	if !found {
		t.Fatal("child not among descendants")
	}
}

func TestUptime(t *testing.T) {
	a, err := Uptime()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := Uptime()
		if err != nil {
			t.Fatal(err)
		}
		if b > a {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("uptime does not advance")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := ParseUptime([]byte("x 1")); err == nil {
		t.Fatal("bad uptime accepted")
	}
	// Uptime is the clock /proc/uptime shows (which rounds to 10 ms).
	b, err := os.ReadFile(Root + "/uptime")
	if err != nil {
		t.Fatal(err)
	}
	file, err := ParseUptime(b)
	if err != nil {
		t.Fatal(err)
	}
	after, err := Uptime()
	if err != nil {
		t.Fatal(err)
	}
	if d := after - file; d < 0 || d > 1 {
		t.Fatalf("Uptime %.6f against /proc/uptime's %.2f read before it", after, file)
	}
}

// TestDescendantsBothWays checks that the children-file walk and the full
// scan (the fallback on kernels without children files) agree on a real
// tree with a setsid'd grandchild.
func TestDescendantsBothWays(t *testing.T) {
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready")
	cmd := exec.Command("/bin/sh", "-c", `sleep 30 & (sleep 30 & wait) & setsid sleep 30 & touch "$1"; wait`, "tree", ready)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, s := range must(Descendants(cmd.Process.Pid)) {
			_ = syscall.Kill(s.PID, syscall.SIGKILL)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := os.Stat(ready)
		// Exactly the four long-lived processes (three sleeps and the
		// subshell): the touch that made the ready file may still be there
		// a moment after it, and would be in one walk and not the other.
		if err == nil && len(must(Descendants(cmd.Process.Pid))) == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("tree not up")
		}
		time.Sleep(5 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	walked := pids(must(Descendants(cmd.Process.Pid)))
	all, err := All()
	if err != nil {
		t.Fatal(err)
	}
	scanned := pids(DescendantsIn(all, cmd.Process.Pid))
	if walked != scanned {
		t.Fatalf("children-file walk %s, full scan %s", walked, scanned)
	}
}

func must(s []Stat, err error) []Stat {
	if err != nil {
		panic(err)
	}
	return s
}

func pids(s []Stat) string {
	var p []int
	for _, x := range s {
		p = append(p, x.PID)
	}
	sort.Ints(p)
	return fmt.Sprint(p)
}
