"""Server overhead A/B in one process on one loaded model: `moespec chat`'s path vs the HTTP server.

Alternates, R times, one answer through ChatSession.send (what `moespec chat` runs) and the same
prompt streamed through the real server (uvicorn in a thread, openai client), greedy, N tokens,
the engine reset before each, so both arms see the same machine load. Reports the decode-step
TPOT of each arm (the recorder's, as `moespec chat --json` reports it) and the wall time per
token between streamed pieces; the last stdout line is one JSON object with medians and ratios.

  PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/serve_ab.py N R [MODEL_DIR]
"""
import sys, time, statistics, json, torch
torch.set_num_threads(1)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "tests"))
from serve_harness import serve
from moespec.serve.app import ServeSettings
from moespec.chat.session import ChatSession
from moespec.config import SamplingConfig, RuntimeConfig
from moespec.runtime.stats import summarize
import openai
N = int(sys.argv[1]); R = int(sys.argv[2])
path = sys.argv[3] if len(sys.argv) > 3 else str(__import__("moespec.paths", fromlist=["x"]).models_dir()
                                                   / "smollm2-135m-moe-e16k4")
P = "Write a short story about a lighthouse keeper."
res = {"chat_step": [], "chat_wall": [], "srv_step": [], "srv_client": []}
with serve(path, ServeSettings(), RuntimeConfig(device="cpu")) as srv:
    b = srv.app.state.backend
    c = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=3600)
    for r in range(R):
        b.engine.reset()
        s = ChatSession(b.engine, b.tokenizer, SamplingConfig(max_new_tokens=N))
        st = []
        text1 = ""
        for piece in s.send(P):
            st.append(time.perf_counter()); text1 += piece
        res["chat_step"].append(s.last.summary.tpot_ms)
        res["chat_wall"].append((st[-1] - st[0]) / (len(s.last.token_ids) - 1) * 1e3)
        b.engine.reset()
        st = []; text2 = ""
        for ch in c.chat.completions.create(model=b.name, messages=[{"role": "user", "content": P}], max_tokens=N,
                                            temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                st.append(time.perf_counter()); text2 += ch.choices[0].delta.content
        res["srv_step"].append(summarize(b.engine.om.recorder.steps).tpot_ms)
        res["srv_client"].append((st[-1] - st[0]) / (N - 1) * 1e3)
        print({k: round(v[-1], 1) for k, v in res.items()}, text1 == text2, flush=True)
med = {k: round(statistics.median(v), 1) for k, v in res.items()}
print(json.dumps({**med, "ratio_step": round(med["srv_step"] / med["chat_step"], 3) if med["chat_step"] else None,
                  "ratio_wall": round(med["srv_client"] / med["chat_wall"], 3) if med["chat_wall"] else None}))
