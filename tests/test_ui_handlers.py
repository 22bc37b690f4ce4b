"""The event handlers called directly (medvqa/ui/handlers.py), where a client of the app cannot reach:
an oversize file that got past Gradio's own limit, and the warming chained to each change of scan,
window, frame or conversation.
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.ui_helpers")  # so that its asserts explain their failures too

from .conftest import prompt_gate  # noqa: E402
from .ui_helpers import MAX_UPLOAD_MB, dicom_file, last_reply  # noqa: E402
from .ui_helpers import ui_pipeline, ui_settings, upload_folder  # noqa: E402, F401 - fixtures


def test_oversize_file_reaching_the_handler_is_refused_with_a_message(tmp_path, ui_pipeline, upload_folder):
    """Where Gradio's own limit is off (or larger), the handler still refuses and says why."""
    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "abc123"
    folder.mkdir()
    big = folder / "big.dcm"
    big.write_bytes(b"\0" * (MAX_UPLOAD_MB * 2**20 + 1))
    _, viewer, *_, chat, session = handlers.upload({"path": str(big)}, None)
    assert "larger than the 1 MB upload limit" in last_reply(chat) and session is None
    assert not folder.exists(), "the refused upload is deleted too"


def test_an_image_too_small_to_read_is_refused_before_the_model_sees_it(ui_pipeline, upload_folder):
    """A 1×1 pixel or a 3000×1 strip used to open and be answered about; now the chat says why not."""
    from PIL import Image

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    for size in ((1, 1), (3000, 1)):
        folder = upload_folder / f"tiny{size[0]}"
        folder.mkdir()
        Image.new("L", size, 90).save(folder / "tiny.png")
        _, viewer, *_, chat, session = handlers.upload({"path": str(folder / "tiny.png")}, None)
        assert session is None and f"This image is {size[0]}×{size[1]} pixels, too small to read" in last_reply(chat)


def test_warming_caches_the_prompt_up_to_the_question_and_never_a_replaced_conversation(
        ui_pipeline, upload_folder):
    """What the app runs after a scan is shown (Handlers.warm, chained to upload, window, frame and
    new conversation): the conversation's prompt up to the question is cached; nothing is cached
    while an answer runs or for a conversation replaced while it warmed."""
    import shutil

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)

    def upload_session():
        folder = upload_folder / f"warm{len(list(upload_folder.iterdir()))}"
        folder.mkdir()
        path = shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm")
        *_, session = handlers.upload({"path": str(path)}, None)
        return session

    session = upload_session()
    handlers.warm(session)
    state = ui_pipeline.engine.prefixes.get(session.conversation.id)
    assert state is not None and len(state.ids) > ui_pipeline.model.vision.num_tokens
    # Typing in the question box warms the prompt for the question so far, all but its last token.
    with prompt_gate(ui_pipeline, "never"):  # the offline profile's: the question follows no passages
        handlers.warm(session, "Is there an effusion?")
    typed = ui_pipeline.engine.prefixes.get(session.conversation.id)
    window = ui_pipeline._prompt_window(session.conversation)
    prompt = ui_pipeline.prompts.build("Is there an effusion?", (), (), window)
    assert len(typed.ids) == len(prompt) - 1 > len(state.ids)
    session.close()

    busy = upload_session()
    busy.current = object()  # an answer is streaming: it warms its own next turn
    handlers.warm(busy)
    assert ui_pipeline.engine.prefixes.get(busy.conversation.id) is None
    busy.current = None

    replaced = upload_session()
    old = replaced.conversation
    original = ui_pipeline.warm_next_turn

    def warm_while_the_window_changes(conversation, draft="", **options):
        done = original(conversation, draft, **options)
        ui_pipeline.end_conversation(replaced.look_at(replaced.scan))  # the window changed meanwhile
        return done

    ui_pipeline.warm_next_turn = warm_while_the_window_changes
    try:
        handlers.warm(replaced)
    finally:
        del ui_pipeline.warm_next_turn
    assert ui_pipeline.engine.prefixes.get(old.id) is None and replaced.conversation is not old
    replaced.close()



def test_the_next_question_is_taken_once_the_answer_is_shown(ui_pipeline, upload_folder):
    """Once an answer is shown complete (with its sources), the next question is answered, not refused,
    though the first answer's event goes on to warm the next turn."""
    import shutil

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "next-question"
    folder.mkdir()
    path = shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm")
    *_, session = handlers.upload({"path": str(path)}, None)
    first = handlers.ask("Describe the image.", session)
    for chat, _ in first:
        if "medvqa-sources" in last_reply(chat):
            break  # shown complete; the event itself has not ended
    else:
        raise AssertionError("the first answer never completed")
    second = list(handlers.ask("Which organ is shown?", session))
    reply = last_reply(second[-1][0])
    assert "Please wait" not in reply and "medvqa-sources" in reply
    list(first)  # the first event ends (its warming) without touching the second answer
    assert session.current is None and [turn["question"] for turn in session.turns] == \
        ["Describe the image.", "Which organ is shown?"]
    session.close()


def test_a_new_window_ends_the_old_conversation_outside_the_sessions_lock(ui_pipeline, upload_folder, monkeypatch):
    """Ending a conversation may wait for the decoder's step in progress; the tab's other events
    (Stop, the chat) take its lock meanwhile, so the lock is let go first."""
    import shutil

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "window-lock"
    folder.mkdir()
    path = shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm")
    *_, session = handlers.upload({"path": str(path)}, None)
    old, ended = session.conversation, []
    end = ui_pipeline.end_conversation

    def end_and_note(conversation, **options):
        ended.append((conversation, session.lock.locked()))
        end(conversation, **options)

    monkeypatch.setattr(ui_pipeline, "end_conversation", end_and_note)
    handlers._render(session, "lung", None)
    assert ended == [(old, False)] and session.conversation is not old
    session.close()


def test_a_double_click_asks_once_and_a_refused_question_goes_back_to_the_box(ui_pipeline, upload_folder):
    """The page sends a double click's question twice (or the box it has just emptied): it is asked once.
    A question the pipeline refuses (too long for the model) comes back to the question box."""
    import shutil

    import gradio as gr

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "double-click"
    folder.mkdir()
    path = shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm")
    *_, session = handlers.upload({"path": str(path)}, None)
    first = handlers.ask("Is there a pleural effusion?", session)
    next(first)  # asked: shown and waiting for its turn
    for again in ("Is there a pleural effusion?", ""):
        updates = list(handlers.ask(again, session))
        assert len(updates) == 1 and isinstance(updates[0][1], type(gr.skip()))
        assert [message["role"] for message in updates[0][0]] == ["user", "assistant"]  # nothing added
    list(first)
    assert [turn["question"] for turn in session.turns] == ["Is there a pleural effusion?"]
    # Once answered, the same question may be asked again straight away.
    list(handlers.ask("Is there a pleural effusion?", session))
    assert len(session.turns) == 2

    too_long = "Is there an effusion? " * 2000
    chat, box = list(handlers.ask(too_long, session))[-1]
    assert "too long" in last_reply(chat) and box == too_long.strip()
    session.close()


def test_window_and_frame_values_beyond_the_sliders_are_brought_within_them(ui_pipeline, upload_folder):
    """Typed in the sliders' boxes, a centre, width or frame out of range is taken as the nearest end of
    the slider (the page sends them unchecked: Gradio's check would put the chat in an error state)."""
    import shutil

    import gradio as gr

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    def opened(name: str):
        folder = upload_folder / f"beyond-{name}"
        folder.mkdir()
        *_, session = handlers.upload({"path": str(shutil.copy(dicom_file(name), folder / name))}, None)
        return session

    session = opened("CT_small.dcm")
    # Focus passing through a box sends the window shown unchanged: nothing changes, the file's window stays.
    shown = session.scan
    unchanged = handlers.set_window(shown.window.center, shown.window.width, 1, session)
    assert all(isinstance(output, type(gr.skip())) for output in unchanged[:6]) and session.scan is shown
    viewer, _, center, width, _, _, chat, session = handlers.set_window(-5000, 0, 1, session)
    assert center.minimum <= -1100 and "user window (C " in viewer and " / W 1)" in viewer
    assert f"C {center.minimum:g} " in viewer and width.value == 1 and not chat  # no error in the chat
    _, _, _, _, _, _, chat, session = handlers.set_window("nan", 400, 1, session)
    assert "must be numbers" in last_reply(chat)
    # A value within range is not sent back: it would overwrite what the user types next in the other box.

    viewer, preset, center, width, *_ = handlers.set_window(50, 300, 1, session)
    assert "user window (C 50 / W 300)" in viewer and preset.value == "custom"
    assert isinstance(center, type(gr.skip())) and isinstance(width, type(gr.skip()))
    _, _, center, width, *_ = handlers.set_window(50, 0, 1, session)
    assert isinstance(center, type(gr.skip())) and width.value == 1  # only the clamped one
    session.close()

    session = opened("rtdose.dcm")  # 15 frames
    viewer, _, _, _, frame, *_ = handlers.set_frame(99, session)
    assert "frame 15 of 15" in viewer and frame.value == 15  # clamped: sent back
    viewer, _, _, _, frame, *_ = handlers.set_frame(7, session)
    assert "frame 7 of 15" in viewer and isinstance(frame, type(gr.skip()))  # as scrolled: left alone
    viewer, *_ = handlers.set_frame(-3, session)
    assert "frame 1 of 15" in viewer
    session.close()


def _upload_picture(handlers, upload_folder, name: str, image):
    """(viewer, preset, centre, width, chat, session) after uploading `image` through the handler."""
    folder = upload_folder / name
    folder.mkdir()
    image.save(folder / name)
    _, viewer, preset, center, width, _frame, _meta, chat, session = handlers.upload({"path": str(folder / name)}, None)
    return viewer, preset, center, width, chat, session


def test_a_16_bit_png_gets_window_controls_over_its_own_values_and_the_model_sees_its_window(
        ui_pipeline, upload_folder):
    """A CT slice exported as a 16-bit PNG is windowed like a DICOM, without the CT presets (its values
    are no Hounsfield units); the window set is what the model sees. 8-bit grey and colour get no controls."""
    import numpy as np
    from PIL import Image

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    values = (np.arange(64 * 64).reshape(64, 64) * 15).astype(np.uint16)  # 0 .. 61425
    viewer, preset, center, width, _, session = _upload_picture(handlers, upload_folder, "ct.png",
                                                                Image.fromarray(values))
    assert "automatic window" in viewer and preset.visible and center.visible and width.visible
    assert preset.choices == [("Automatic (0.5–99.5 %)", "auto"), ("Custom (sliders)", "custom")]
    assert preset.value == "auto" and (center.value, width.value) == (session.scan.window.center,
                                                                      session.scan.window.width)
    assert (center.minimum, center.maximum, width.minimum, width.maximum, center.step) == (0, 61425, 1, 61425, 1)

    viewer, preset, center, width, *_ = handlers.set_window(30000, 20000, 1, session)
    assert "user window (C 30000 / W 20000)" in viewer and preset.value == "custom"
    expected = np.clip(np.rint((values / 20000 - 1) * 255), 0, 255).astype(np.uint8)  # 30000 ± 10000 → 0..255
    np.testing.assert_array_equal(session.scan.pixels[..., 0], expected)
    assert session.conversation.image is session.scan.pixels  # the model sees exactly what is shown
    assert session.conversation.window == "user window (C 30000 / W 20000)"

    shown = session.scan
    *_, chat, _ = handlers.set_preset("lung", 1, session)
    assert "Hounsfield units, which a PNG image does not have" in last_reply(chat) and session.scan is shown
    viewer, preset, *_ = handlers.set_preset("auto", 1, session)
    assert "automatic window" in viewer and preset.value == "auto"
    session.close()

    ramp = np.linspace(0.0, 0.5, 32 * 32, dtype=np.float32).reshape(32, 32)  # a float TIFF, under one unit
    _, preset, center, width, _, session = _upload_picture(handlers, upload_folder, "map.tiff",
                                                           Image.fromarray(ramp, "F"))
    assert preset.visible and (center.minimum, center.maximum, center.step) == (0, 0.5, 0.001)
    assert (width.minimum, width.maximum) == (0.001, 0.5)
    handlers.set_window(0.25, 0.1, 1, session)  # narrower than one unit: still a window
    assert session.scan.window.describe() == "user window (C 0.25 / W 0.1)"
    assert session.scan.pixels[0, 0, 0] == 0 and session.scan.pixels[-1, -1, 0] == 255
    session.close()

    for name, image in (("gray8.png", Image.new("L", (32, 32), 90)), ("colour.png", Image.new("RGB", (32, 32)))):
        _, preset, center, width, _, session = _upload_picture(handlers, upload_folder, name, image)
        assert not (preset.visible or center.visible or width.visible), name
        session.close()


def test_a_new_scan_says_the_previous_conversation_is_closed(ui_pipeline, upload_folder):
    """Opening another scan starts a new conversation; where the previous one had answers, the new chat
    says it is gone and how to keep one (export first). A first upload's chat is empty."""
    import shutil

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)

    def opened(name: str, session):
        folder = upload_folder / f"closed-{len(list(upload_folder.iterdir()))}"
        folder.mkdir()
        *_, chat, session = handlers.upload({"path": str(shutil.copy(dicom_file(name), folder / name))}, session)
        return chat, session

    chat, session = opened("CT_small.dcm", None)
    assert chat == []
    list(handlers.ask("Is there a pleural effusion?", session))
    chat, session = opened("MR_small.dcm", session)
    assert len(chat) == 1 and "the previous one (1 answer, about the other scan) is closed" in chat[0]["content"]
    assert "export it before opening another scan" in chat[0]["content"] and session.turns == []
    chat, session = opened("CT_small.dcm", session)
    assert chat == []  # nothing was asked about the MR
    session.close()


def test_a_cleared_conversation_can_be_restored_until_the_next_question(ui_pipeline, upload_folder):
    """New conversation (or the chat's bin) used to drop the chat for good, one misplaced click from
    losing it; the conversation is now set aside and Restore brings it back, answers, export and
    history, until a question is asked in the new one (or another scan opens)."""
    import shutil

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "restore"
    folder.mkdir()
    *_, session = handlers.upload({"path": str(shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm"))}, None)
    assert handlers.restore_offer(session)["visible"] is False
    for question in ("Is there a pleural effusion?", "Which organ is shown?"):
        list(handlers.ask(question, session))
    before = [dict(message) for message in session.messages]
    assert handlers.new_conversation(session) == ([], "", "") and session.turns == []
    assert session.conversation.history == []
    handlers.new_conversation(session)  # clearing the empty chat keeps what the first clear set aside
    offer = handlers.restore_offer(session)
    assert offer["visible"] is True and offer["value"] == "Restore the cleared conversation (2 answers)"

    chat, button = handlers.restore_conversation(session)
    assert chat == before and button["visible"] is False and handlers.restore_offer(session)["visible"] is False
    assert [turn["question"] for turn in session.turns] == ["Is there a pleural effusion?", "Which organ is shown?"]
    assert [turn.question for turn in session.conversation.history] == \
        ["Is there a pleural effusion?", "Which organ is shown?"]
    list(handlers.ask("Is it a CT?", session))  # the restored conversation goes on
    assert len(session.turns) == 3 and len(session.conversation.history) == 3

    handlers.new_conversation(session)
    list(handlers.ask("Is there a mass?", session))  # a question in the new conversation lets the old one go
    assert handlers.restore_offer(session)["visible"] is False
    chat, button = handlers.restore_conversation(session)
    assert "There is no cleared conversation to restore" in last_reply(chat) and button["visible"] is False
    assert [turn["question"] for turn in session.turns] == ["Is there a mass?"]
    session.close()


def test_a_conversation_cleared_mid_answer_comes_back_as_stop_would_leave_it(ui_pipeline, upload_folder):
    """Cleared while an answer streamed and a question waited behind it: Restore brings the answer back
    marked stopped and the waiting question marked not asked, whatever their cancelled threads write
    afterwards; a question refused in the new conversation (too long) keeps the cleared one."""
    import shutil

    from medvqa.ui.handlers import _Handlers
    from medvqa.ui.session import _Answer

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "restore-mid-answer"
    folder.mkdir()
    *_, session = handlers.upload({"path": str(shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm"))}, None)
    list(handlers.ask("Is there a pleural effusion?", session))
    # An answer streaming and a question waiting behind it, as ask leaves them.
    streaming, waiting = _Answer("Is the heart enlarged?", session.scan), _Answer("Is it a CT?", session.scan)
    streaming.text = "The heart"
    for answer, content in ((streaming, "The heart"), (waiting, "Waiting for the previous answer…")):
        session.messages += [{"role": "user", "content": answer.question},
                             {"role": "assistant", "content": content}]
        answer.reply = session.messages[-1]
    session.current, session.waiting = streaming, [waiting]
    handlers.new_conversation(session)
    streaming.reply["content"] = "The heart is enlarged"  # the cancelled threads write on
    waiting.reply["content"] = "Searching the literature…"
    session.current, session.waiting = None, []  # (their events end)
    chat, _ = handlers.restore_conversation(session)
    assert chat[3]["content"] == "The heart\n\n_(stopped)_" and "Not asked" in chat[5]["content"]
    assert [(turn["question"], turn["stopped"]) for turn in session.turns] == \
        [("Is there a pleural effusion?", False), ("Is the heart enlarged?", True)]

    handlers.new_conversation(session)
    refused = list(handlers.ask("Is there a mass? " * 2000, session))
    assert "too long" in last_reply(refused[-1][0]) and handlers.restore_offer(session)["visible"] is True
    session.close()


def test_stop_marks_its_own_answer_and_says_the_questions_waiting_are_not_asked(ui_pipeline, upload_folder):
    """Stop marks the answer it stopped (not the last message: a question asked meanwhile follows it) and
    says at once that the questions waiting behind it are not asked."""
    import shutil

    from medvqa.ui.handlers import _Handlers
    from medvqa.ui.session import _Answer

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "stop-waiting"
    folder.mkdir()
    *_, session = handlers.upload({"path": str(shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm"))}, None)
    streaming, waiting = _Answer("Is the heart enlarged?", session.scan), _Answer("Is it a CT?", session.scan)
    for answer, content in ((streaming, "The heart"), (waiting, "Waiting for the previous answer…")):
        session.messages += [{"role": "user", "content": answer.question},
                             {"role": "assistant", "content": content}]
        answer.reply = session.messages[-1]
    session.current, session.waiting = streaming, [waiting]
    chat = handlers.stop(session)
    assert chat[1]["content"] == "The heart\n\n_(stopped)_" and "Not asked" in chat[3]["content"]
    assert "medvqa-note" in chat[3]["content"] and [turn["stopped"] for turn in session.turns] == [True]
    session.waiting = []
    session.close()


def _session_for(handlers, upload_folder, name):
    import shutil

    folder = upload_folder / name
    folder.mkdir()
    *_, session = handlers.upload({"path": str(shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm"))}, None)
    return session


def test_an_answer_stopped_or_cleared_ends_without_painting_over_what_ended_it(ui_pipeline, upload_folder):
    """Gradio sends an event's last output again when it completes, after whatever another event showed
    meanwhile: an answer's last output is the chat as it stands, and once a Stop (or New conversation,
    or a new scan) has moved on, no change at all, so the "(stopped)" mark or the emptied chat stays."""
    import gradio as gr

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    session = _session_for(handlers, upload_folder, "stop-last-output")
    updates = list(handlers.ask("Is there a pleural effusion?", session))
    assert updates[-1][0] == updates[-2][0] and "medvqa-sources" in last_reply(updates[-1][0])

    for end in (handlers.stop, handlers.new_conversation):
        answer = handlers.ask("Describe the image.", session)
        next(answer), next(answer)  # shown, and its turn taken
        ended = end(session)
        rest = list(answer)
        assert rest and all(isinstance(part, type(gr.skip())) for update in rest for part in update), end
        if end is handlers.stop:
            assert ended[-1]["content"].endswith("_(stopped)_")
        assert not session.in_flight
    session.close()


def test_a_question_asked_before_a_stop_or_clear_that_arrived_first_is_dropped(ui_pipeline, upload_folder):
    """The page takes a question out of the box and sends it on to be answered (layout._take_question);
    a Stop, New conversation or new scan can reach the app between the two. The question goes with
    what it was asked in: nothing is added to the chat that replaced it."""
    import gradio as gr

    from medvqa.ui.handlers import _Handlers, pack_asked

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    session = _session_for(handlers, upload_folder, "asked-before")
    for end in (handlers.stop, handlers.new_conversation):
        packed = pack_asked("Is there a pleural effusion?", session)
        before = list(session.messages)
        end(session)
        after = list(session.messages)
        updates = list(handlers.ask(packed, session))
        assert updates == [(gr.skip(), gr.skip())] or all(
            isinstance(part, type(gr.skip())) for update in updates for part in update)
        assert session.messages == after and (end is handlers.stop or not after), before
    # Asked in the generation it arrives in, it is answered, with the words as typed.
    updates = list(handlers.ask(pack_asked("Is there a pleural effusion?", session), session))
    assert session.turns[-1]["question"] == "Is there a pleural effusion?"
    assert "asked in" not in str(updates[-1][0])
    # A script's /ask call (no packing) is answered as before.
    list(handlers.ask("Is it a CT?", session))
    assert session.turns[-1]["question"] == "Is it a CT?"
    session.close()


def test_stop_waits_for_the_stopped_answers_last_snapshot_to_leave(ui_pipeline, upload_folder):
    """A snapshot the answer made just before Stop reaches the page before Stop's chat (session.settle)."""
    import threading
    import time

    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    session = _session_for(handlers, upload_folder, "settle")
    with session.lock:
        session.sending(session.generation)  # made, not yet seen sent
    generation, returned = session.generation, []
    stopping = threading.Thread(target=lambda: returned.append(handlers.stop(session)))
    stopping.start()
    time.sleep(0.3)
    assert not returned, "Stop returned before the snapshot left"
    session.sent(generation)
    stopping.join(5)
    assert returned and not session.in_flight
    session.close()


def test_an_emptied_box_shows_the_value_again_and_a_late_series_pick_says_nothing(ui_pipeline, upload_folder):
    from medvqa.ui.handlers import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    session = _session_for(handlers, upload_folder, "emptied")
    chat_before = list(session.messages)
    for out in (handlers.set_frame(None, session), handlers.set_frame("", session),
                handlers.set_window("", 400, 1, session)):
        viewer, preset, center, width, frame, meta, chat, same = out
        assert frame["value"] == session.scan.frame_index + 1 and same is session
        assert not isinstance(chat, list) and session.messages == chat_before  # the chat is not touched
    *_, chat, _ = handlers.set_series(2, session)  # a single file: the picker is hidden
    assert chat == chat_before
    session.close()
