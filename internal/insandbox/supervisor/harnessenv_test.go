package supervisor

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestHarnessHome: the harness's HOME is the given home when its uid owns
// it, else the environment's when its uid owns that, else none; never a
// directory another uid owns. The shim's variable carries the home.
func TestHarnessHome(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to give a directory to another uid; CI runs as root")
	}
	base := t.TempDir()
	mine := filepath.Join(base, "agent")
	theirs := filepath.Join(base, "root")
	for _, d := range []string{mine, theirs} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(mine, 4242, 4242); err != nil {
		t.Fatal(err)
	}
	home := func(env []string) string {
		for _, kv := range env {
			if v, ok := strings.CutPrefix(kv, "HOME="); ok {
				return v
			}
		}
		return ""
	}
	for _, c := range []struct {
		name string
		u    HarnessUser
		env  []string
		want string
	}{
		{"given and owned", HarnessUser{UID: 4242, GID: 4242, Home: mine}, []string{"HOME=" + theirs}, mine},
		{"given, not owned, env owned", HarnessUser{UID: 4242, GID: 4242, Home: theirs}, []string{"HOME=" + mine}, mine},
		{"none owned", HarnessUser{UID: 4242, GID: 4242, Home: theirs}, []string{"HOME=" + theirs}, ""},
		{"missing", HarnessUser{UID: 4242, GID: 4242, Home: filepath.Join(base, "gone")}, nil, ""},
	} {
		got := harnessEnv(c.env, c.u)
		if h := home(got); h != c.want {
			t.Errorf("%s: HOME %q, want %q (env %v)", c.name, h, c.want, got)
		}
	}
	env, u, err := shimHarnessUser([]string{"A=1", ShimHarnessEnv + "=4242:4242:" + mine})
	if err != nil || u == nil || u.Home != mine || !slices.Equal(env, []string{"A=1"}) {
		t.Fatalf("shim variable with a home: %v %+v %v", env, u, err)
	}
	if _, u, err := shimHarnessUser([]string{ShimHarnessEnv + "=4242:4242"}); err != nil || u.Home != "" {
		t.Fatalf("shim variable without a home: %+v %v", u, err)
	}
	for _, bad := range []string{"4242", "4242:x", "4242:4242:relative", "0:0"} {
		if _, _, err := shimHarnessUser([]string{ShimHarnessEnv + "=" + bad}); err == nil {
			t.Errorf("shim variable %q accepted", bad)
		}
	}
}
