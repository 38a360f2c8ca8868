package system_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"stasis/errdefs"
	"stasis/internal/control/system"
)

// A configuration Open cannot serve is refused as invalid, naming what to
// change, before anything is made: no state directory, no socket.
func TestOpenRefusesBeforeMakingAnything(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  func(state string) system.Config
		says string
	}{
		{"no state", func(string) system.Config { return system.Config{} }, "no state directory"},
		{"unknown provider", func(s string) system.Config { return system.Config{State: s, Provider: "nimbus"} }, "nimbus"},
		{"clock policy", func(s string) system.Config { return system.Config{State: s, ClockPolicy: "sundial"} }, "use continuous or host"},
		{"hosted without a gateway listener", func(s string) system.Config { return system.Config{State: s, Provider: "e2b"} }, "--gateway-listen"},
		{"blobs for a provider that keeps its own", func(s string) system.Config {
			return system.Config{State: s, Provider: "e2b", GatewayListen: "127.0.0.1:0", Blobs: "s3://bucket/run"}
		}, "the providers that keep them in S3 are local, microvm"},
	} {
		t.Run(c.name, func(t *testing.T) {
			state := filepath.Join(t.TempDir(), "state")
			s, err := system.Open(context.Background(), c.cfg(state))
			if err == nil {
				_ = s.Close()
				t.Fatal("opened")
			}
			if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("error %v: want an invalid one saying %q", err, c.says)
			}
			if _, err := os.Stat(state); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the state directory was made: %v", err)
			}
			sock, err := system.GatewaySocket(state)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Dir(sock)); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the gateway's socket directory was made: %v", err)
			}
		})
	}
}

// The gateway's socket depends only on the state directory, so a system
// opened again on it is reached at the same path, and is short enough for
// a unix socket whatever the directory.
func TestGatewaySocketIsTheStatesOwn(t *testing.T) {
	a, err := system.GatewaySocket("/var/lib/" + strings.Repeat("x", 200))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := system.GatewaySocket("/var/lib/" + strings.Repeat("x", 200) + "/.")
	c, _ := system.GatewaySocket("/var/lib/other")
	if a != b || a == c || len(a) >= 108 {
		t.Fatalf("sockets %q %q %q", a, b, c)
	}
}
