package cli_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"stasis/internal/stasistest"
)

// skipUnlessModelRegistered skips while cli/root.go does not list the model
// command yet.
func skipUnlessModelRegistered(t *testing.T) {
	t.Helper()
	if _, errOut, code := stasis(t, "model", "--help"); code != 0 && strings.Contains(errOut, "unknown command") {
		t.Skip("stasis model is not registered in cli/root.go")
	}
}

// startModel starts "stasis model" and returns it with the address it
// printed.
func startModel(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(stasistest.Exe(), append([]string{"model", "--log-level", "warn"}, args...)...)
	cmd.Env = append(os.Environ(), stasistest.Env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(out).ReadString('\n')
		line <- strings.TrimSpace(s)
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case addr := <-line:
		if addr == "" {
			t.Fatal("stasis model printed no address")
		}
		return cmd, addr
	case <-time.After(30 * time.Second):
		t.Fatal("stasis model printed no address within 30s")
	}
	return nil, ""
}

// stopModel sends SIGTERM and expects exit 0 within a deadline.
func stopModel(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("stasis model after SIGTERM: %v, want exit 0", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("stasis model did not exit within 30s of SIGTERM")
	}
}

func chatOnce(t *testing.T, client *http.Client, base string) {
	t.Helper()
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"read_file"}}]}`
	resp, err := client.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var c struct {
		Object  string `json:"object"`
		Choices []struct {
			Message struct {
				ToolCalls []struct {
					Function struct {
						Name string `json:"name"`
					} `json:"function"`
				} `json:"tool_calls"`
			} `json:"message"`
			TokenIDs []int64 `json:"token_ids"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil || resp.StatusCode != 200 || c.Object != "chat.completion" ||
		len(c.Choices) != 1 || len(c.Choices[0].Message.ToolCalls) != 1 || c.Choices[0].Message.ToolCalls[0].Function.Name != "read_file" ||
		len(c.Choices[0].TokenIDs) == 0 {
		t.Fatalf("chat completion: status %d, %v, %+v", resp.StatusCode, err, c)
	}
}

func TestModelServesUntilSIGTERM(t *testing.T) {
	skipUnlessModelRegistered(t)
	defer stasistest.NoChildrenLeft(t)
	cmd, addr := startModel(t, "--listen", "127.0.0.1:0", "--seed", "3")
	if _, port, err := net.SplitHostPort(addr); err != nil || port == "0" {
		t.Fatalf("printed address %q", addr)
	}
	chatOnce(t, http.DefaultClient, "http://"+addr)
	stopModel(t, cmd)
}

func TestModelServesOnUnixSocket(t *testing.T) {
	skipUnlessModelRegistered(t)
	defer stasistest.NoChildrenLeft(t)
	sock := filepath.Join(t.TempDir(), "model.sock")
	// A stale socket from a dead server is replaced.
	if ln, err := net.Listen("unix", sock); err != nil {
		t.Fatal(err)
	} else {
		ln.(*net.UnixListener).SetUnlinkOnClose(false)
		ln.Close()
	}
	cmd, addr := startModel(t, "--listen", "unix:"+sock, "--script", writeScript(t))
	if addr != "unix:"+sock {
		t.Fatalf("printed %q, want unix:%s", addr, sock)
	}
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	chatOnce(t, client, "http://model")
	// A second server on the same live socket is refused.
	if _, errOut, code := stasis(t, "model", "--listen", "unix:"+sock); code != 1 || !strings.Contains(errOut, "already answers") {
		t.Errorf("second server: exit %d, %s", code, errOut)
	}
	stopModel(t, cmd)
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left after shutdown: %v", err)
	}
}

func writeScript(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "script.json")
	if err := os.WriteFile(p, []byte(`[{"tool_calls":[{"name":"read_file","arguments":{"path":"x"}}]},{"content":"done"}]`), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestModelUsageErrors(t *testing.T) {
	skipUnlessModelRegistered(t)
	bad := filepath.Join(t.TempDir(), "bad.json")
	if err := os.WriteFile(bad, []byte(`[{}]`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"model"}, 2, "--listen is required"},
		{[]string{"model", "--listen", "127.0.0.1:0", "--fail", "1.5"}, 2, "from 0 to 1"},
		{[]string{"model", "--listen", "127.0.0.1:0", "--token-delay", "-1s"}, 2, "must not be negative"},
		{[]string{"model", "--listen", "127.0.0.1:0", "--script", bad}, 2, "turn 0"},
		{[]string{"model", "--listen", "127.0.0.1:0", "--script", filepath.Join(t.TempDir(), "none.json")}, 2, "no such file"},
		{[]string{"model", "--listen", "unix:"}, 1, "needs a path"},
		{[]string{"model", "--listen", "256.1.1.1:99999"}, 1, "--listen"},
	} {
		_, errOut, code := stasis(t, c.args...)
		if code != c.code || !strings.Contains(errOut, c.says) {
			t.Errorf("stasis %v: exit %d, stderr %q; want exit %d saying %q", c.args, code, errOut, c.code, c.says)
		}
	}
}
